"""Engine flags shared by generate, chat, demo, serve and the benchmarks."""
from __future__ import annotations


def add_engine_args(p, kv_cache_memory: str = "1GiB", max_num_seqs: int = 64) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto "
                                                   "(float32 on CPU)")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto")
    g.add_argument("--kv-cache-memory", default=kv_cache_memory,
                   help=f"KV-cache budget, e.g. 512MiB, 2GiB (default {kv_cache_memory})")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, run decode steps without CUDA graphs")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def llm_from_args(args):
    import torch

    from kvslim.engine.llm import LLM
    if args.threads:
        torch.set_num_threads(args.threads)
    return LLM(args.model, dtype=args.dtype, device=args.device,
               kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
               enforce_eager=args.enforce_eager)


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
    from kvslim.engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed,
                          stop=args.stop)
