"""Engine flags shared by generate, chat, demo, serve and the benchmarks: generated from
EngineConfig's fields (engine/config.py), where each engine option is declared once."""
from __future__ import annotations

# The tensor-parallel options: last in the engine group, and what the benchmarks pass on.
PARALLEL_OPTIONS = ("tensor_parallel_size", "tensor_parallel_oversubscribe",
                    "distributed_timeout")
THREADS_HELP = ("torch CPU threads (default: one per core). On cores that other busy processes "
                "share, fewer threads (often 1) decode faster")


def add_engine_args(p, **defaults) -> None:
    """Every engine option's flag, and --threads. `defaults`: this command's own default for an
    option, e.g. kv_cache_memory="256MiB"."""
    g = p.add_argument_group("engine")
    overrides = {name: {"default": value} for name, value in defaults.items()}
    add_engine_flags(g, *[f.name for f in flag_fields() if f.name not in PARALLEL_OPTIONS],
                     **overrides)
    add_threads_arg(g)
    add_engine_flags(g, *PARALLEL_OPTIONS, **overrides)


def add_threads_arg(p, help: str = THREADS_HELP) -> None:
    p.add_argument("--threads", type=int, default=None, help=help)


def flag_fields() -> list:
    """EngineConfig's fields that have a CLI flag, in declaration order."""
    from dataclasses import fields

    from kvslim.engine.config import EngineConfig
    return [f for f in fields(EngineConfig) if f.metadata["flag"] is not None]


def flag_of(f) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def add_engine_flags(p, *names: str, **overrides: dict) -> None:
    """The flags of the engine options `names` (EngineConfig's field names), generated from the
    fields: type, default, choices, metavar and help. `overrides[name]`: add_argument keywords
    that replace the field's for this command (its own default, narrower choices, its help),
    and `aliases`, more spellings of the flag. Every command's --dtype is declared here: the
    engine's, or the engine's with this command's own meaning."""
    import typing

    from kvslim.engine.config import EngineConfig
    hints = typing.get_type_hints(EngineConfig)
    by_name = {f.name: f for f in flag_fields()}
    unknown = [n for n in (*names, *overrides) if n not in by_name]
    assert not unknown, f"not engine options with a flag: {unknown}"
    for name in names:
        f, meta = by_name[name], by_name[name].metadata
        kwargs = {"help": meta["help"]}
        if hints[name] is bool:
            # store_true: a False default switches on, a True default is --no-... (switch off)
            assert f.default is False or flag_of(f).startswith("--no-"), flag_of(f)
            kwargs["action"] = "store_true"
        else:
            kinds = [t for t in typing.get_args(hints[name]) or (hints[name],)
                     if t is not type(None)]
            if meta["parse"] is None and len(kinds) == 1 and kinds[0] in (int, float):
                kwargs["type"] = kinds[0]
            kwargs["default"] = f.default
            kwargs.update({k: meta[k] for k in ("choices", "metavar") if meta[k] is not None})
        kwargs.update(overrides.get(name, {}))
        aliases = kwargs.pop("aliases", ())
        if aliases:
            kwargs["dest"] = flag_of(f).removeprefix("--").replace("-", "_")
        p.add_argument(flag_of(f), *aliases, **kwargs)


def engine_options_from_args(args) -> dict:
    """EngineConfig's keyword arguments from the engine flags the command has (an option
    without its flag here keeps the field's default). Parsing a flag's text (JSON) happens
    here, so that its error is a one-line KvslimError."""
    options = {}
    for f in flag_fields():
        dest = flag_of(f).removeprefix("--").replace("-", "_")
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if f.default is True:                    # --no-...
            value = not value
        elif f.metadata["parse"] is not None and value is not None:
            value = f.metadata["parse"](value)
        options[f.name] = value
    return options


def llm_from_args(args):
    """Check every flag first (a mistake costs a second, not a model load), then load. The
    model name goes to LLM as typed: which import of a GGUF model runs at --dtype is LLM's
    rule (`engine_model_dir`); resolving it here first (an import happens once, cached) names
    the directory before the load."""
    import sys

    import torch

    from kvslim.engine.llm import LLM
    from kvslim.formats.registry import engine_model_dir
    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    options = engine_options_from_args(args)
    model_dir = engine_model_dir(args.model, options["dtype"])
    print(f"kvslim: loading {model_dir} ...", file=sys.stderr, flush=True)
    return LLM(args.model, **options)


def check_args(args) -> None:
    """What loading the model would reject later: sampling flags (when the command has them),
    engine sizes, and the engine's KV-cache plan (one block fits kv_cache_memory, max_model_len
    fits the cache), from the model's config read without its weights."""
    from kvslim.attention import resolve_kv_cache_dtype
    from kvslim.errors import KvslimError
    from kvslim.device import resolve_device
    from kvslim.formats.loader import resolve_dtype
    from kvslim.formats.registry import model_config_of
    from kvslim.engine.parallel_executor import check_tensor_parallel
    from kvslim.kv_cache.plan import plan_kv_cache
    from kvslim.parallel import local_config
    if args.threads is not None and args.threads < 1:
        raise KvslimError(f"--threads must be at least 1, got {args.threads}")
    if hasattr(args, "max_tokens"):              # demo has --max-tokens alone
        sampling_from_args(args)
    config = engine_config_from_args(args)
    model_config = model_config_of(args.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, model_config, device)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    check_tensor_parallel(model_config, config)
    # The engine's own plan: kv_cache_memory is per rank, and a rank's cache holds its KV heads
    plan_kv_cache(local_config(model_config, config.tensor_parallel_size), kv_dtype, config)


def engine_config_from_args(args):
    from kvslim.engine.config import EngineConfig
    return EngineConfig(**engine_options_from_args(args))


def parallel_from_args(args) -> dict:
    """The tensor-parallel options (for the benchmarks' LLM); defaults for a command without
    the flags."""
    from kvslim.engine.config import EngineConfig
    options = engine_options_from_args(args)
    return {name: options.get(name, EngineConfig.__dataclass_fields__[name].default)
            for name in PARALLEL_OPTIONS}


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
