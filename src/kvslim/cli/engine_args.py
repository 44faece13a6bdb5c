"""Engine flags shared by generate, chat, demo, serve and the benchmarks."""
from __future__ import annotations


def add_engine_args(p, kv_cache_memory: str = "1GiB", max_num_seqs: int = 64) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto "
                                                   "(float32 on CPU; the default model and "
                                                   ".gguf files run their quantized import, "
                                                   "any other value their float one)")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto")
    g.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8_e4m3"),
                   help="KV-cache storage: auto (the model's dtype), int8 or fp8_e4m3, with a "
                        "float16 scale per token and KV head (default auto)")
    g.add_argument("--kv-cache-memory", default=kv_cache_memory,
                   help=f"KV-cache budget, e.g. 512MiB, 2GiB (default {kv_cache_memory})")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps without CUDA graphs")
    g.add_argument("--attention-backend", default="auto", choices=("auto", "gather", "flex"),
                   help="paged attention: gather (copies each context out, the reference), flex "
                        "(FlexAttention reading the cache in place) or auto (flex on CUDA, "
                        "gather on the CPU, where it measured faster; a quantized KV cache "
                        "always gathers)")
    g.add_argument("--keep-out-of-window-blocks", action="store_true",
                   help="sliding-window layers keep every KV block (their window only masks) "
                        "instead of releasing the blocks that fell out of it")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 3}\' or \'{"method": "draft", "model": DIR, '
                        '"num_speculative_tokens": 4}\' (options: docs/speculative.md)')
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: one per core). On cores that other busy "
                        "processes share, fewer threads (often 1) decode faster")
    add_parallel_args(g)


def add_parallel_args(g) -> None:
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N ranks, each with its own KV-cache share "
                        "(--kv-cache-memory is per rank); ranks run as local processes, or one "
                        "per torchrun process (RANK/WORLD_SIZE set) across machines")
    g.add_argument("--tensor-parallel-oversubscribe", action="store_true",
                   help="allow more tensor-parallel ranks on this machine than CPU cores")
    g.add_argument("--distributed-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a rank that does not answer a collective within this fails the engine "
                        "(default 60)")


def llm_from_args(args):
    """Check every flag first (a mistake costs a second, not a model load), then load."""
    import sys

    import torch

    from kvslim.engine.llm import LLM
    from kvslim.formats.registry import resolve_model
    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, quantized=args.dtype == "auto")
    print(f"kvslim: loading {model_dir} ...", file=sys.stderr, flush=True)
    return LLM(str(model_dir), dtype=args.dtype, device=args.device,
               kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
               enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
               keep_out_of_window_blocks=args.keep_out_of_window_blocks,
               attention_backend=args.attention_backend,
               speculative=speculative_from_args(args), **parallel_from_args(args))


def check_args(args) -> None:
    """What loading the model would reject later: sampling flags (when the command has them),
    engine sizes, and that one KV-cache block fits kv_cache_memory (from the model's config,
    read without its weights)."""
    from kvslim.attention import resolve_kv_cache_dtype
    from kvslim.engine.config import num_kv_blocks
    from kvslim.engine.model_runner import kv_block_bytes
    from kvslim.errors import KvslimError
    from kvslim.device import resolve_device
    from kvslim.formats.loader import resolve_dtype
    from kvslim.formats.registry import model_config_of
    from kvslim.engine.parallel_executor import check_tensor_parallel
    from kvslim.models.kv_groups import kv_cache_groups
    from kvslim.parallel import local_config
    if args.threads is not None and args.threads < 1:
        raise KvslimError(f"--threads must be at least 1, got {args.threads}")
    if hasattr(args, "max_tokens"):              # demo has --max-tokens alone
        sampling_from_args(args)
    config = engine_config_from_args(args)
    model_config = model_config_of(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, model_config, device)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, device)
    check_tensor_parallel(model_config, config)
    # kv_cache_memory is per rank, and a rank's cache holds its KV heads
    model_config = local_config(model_config, config.tensor_parallel_size)
    groups = kv_cache_groups(model_config, not config.keep_out_of_window_blocks)
    num_kv_blocks(config, kv_block_bytes(model_config, config.block_size, kv_dtype, groups))


def engine_config_from_args(args):
    from kvslim.engine.config import EngineConfig
    return EngineConfig(
        kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
        kv_cache_dtype=args.kv_cache_dtype,
        keep_out_of_window_blocks=args.keep_out_of_window_blocks,
        attention_backend=args.attention_backend,
        speculative=speculative_from_args(args), **parallel_from_args(args))


def parallel_from_args(args) -> dict:
    """The tensor-parallel fields of EngineConfig (and LLM); defaults for a command without
    the flags."""
    return dict(tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                tensor_parallel_oversubscribe=getattr(args, "tensor_parallel_oversubscribe",
                                                      False),
                distributed_timeout=getattr(args, "distributed_timeout", 60.0))


def speculative_from_args(args) -> dict | None:
    """--speculative-config's JSON object, or None."""
    import json

    from kvslim.errors import KvslimError
    text = getattr(args, "speculative_config", None)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise KvslimError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise KvslimError("--speculative-config must be a JSON object, e.g. "
                          '\'{"method": "ngram", "num_speculative_tokens": 3}\'')
    return value


def add_sampling_args(p, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args):
    """SamplingParams from the flags; an error names the flag (--max-tokens), not the field."""
    from kvslim.engine.sampling_params import SamplingParams
    from kvslim.errors import InvalidRequestError, KvslimError
    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "seed", "stop")
    try:
        return SamplingParams(**{name: getattr(args, name) for name in names
                                 if hasattr(args, name)})
    except InvalidRequestError as e:
        flag = f"--{e.param.replace('_', '-')}: " if e.param else ""
        raise KvslimError(f"{flag}{e}") from None
