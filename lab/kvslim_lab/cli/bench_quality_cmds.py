"""`kvslim bench kv-quality`: KV-cache settings compared through the engine (capacity,
perplexity read back through the cache, passkey retrieval, decode speed)."""
from __future__ import annotations

from kvslim.cli.engine_args import add_engine_flags, add_threads_arg
from kvslim.errors import KvslimError

DEFAULT_SETTINGS = "float,bf16,int8,fp8,int4,int2,int4+rot,int2+rot"


def register_kv_quality(kinds) -> None:
    p = kinds.add_parser("kv-quality", help="KV-cache settings (float, int8, int4+rot, windows) "
                                            "compared: capacity, perplexity, passkey, speed")
    p.add_argument("--model", action="append", default=None,
                   help="model (repeatable; default: the embedded model, float32 import)")
    p.add_argument("--settings", nargs="+", default=[DEFAULT_SETTINGS], metavar="SETTING",
                   help="KV-cache settings: float, bf16, int8, fp8, int4, int2, a +rot suffix "
                        "(Hadamard rotation), ,w=TOKENS (window) ,s=TOKENS (sink tokens); "
                        "space or comma separated, e.g. 'float,int8,int4+rot,int4,w=1024,s=4'; "
                        "one the engine does not take is reported as not supported (default "
                        f"{DEFAULT_SETTINGS})")
    add_engine_flags(p, "kv_cache_memory", kv_cache_memory=dict(
        default="1GiB", help="the KV budget of every engine, and the one capacity is counted "
                             "in (default 1GiB)"))
    p.add_argument("--context", type=int, default=4096,
                   help="capacity: sequences of this many tokens that fit (default 4096)")
    p.add_argument("--data", default="../shared/corpus/test.txt", help="perplexity text file")
    p.add_argument("--max-tokens", type=int, default=8192, help="perplexity: first N tokens")
    p.add_argument("--window", type=int, default=512, help="perplexity windows (default 512)")
    p.add_argument("--chunk", type=int, default=64,
                   help="prefill chunk (max_num_batched_tokens) of the perplexity and passkey "
                        "runs: small, so each chunk attends to cached tokens (default 64)")
    p.add_argument("--passkey-contexts", default="1024,2048,4096",
                   help="comma list of prompt lengths in tokens ('' for none)")
    p.add_argument("--passkey-depths", default="0.1,0.5,0.9",
                   help="where the key sits in the filler, 0..1 (one case per depth)")
    p.add_argument("--passkey-tokens", type=int, default=8, help="greedy tokens of the answer")
    p.add_argument("--speed-batches", default="1,32",
                   help="decode tokens/s at these batches ('' for none)")
    p.add_argument("--speed-tokens", type=int, default=64, help="new tokens of the speed runs")
    p.add_argument("--no-dense", action="store_true",
                   help="skip the dense perplexity (no cache) that checks the float cache's")
    p.add_argument("--seed", type=int, default=0, help="the passkeys' seed")
    p.add_argument("--out", default="docs/kv_quality",
                   help="folder of kv_quality.json, .md and .png (default docs/kv_quality)")
    add_threads_arg(p, help="torch threads")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_kv_quality_cmd)
    from kvslim_lab.cli.bench_budget_cmds import register_kv_budget, register_kv_demotion
    register_kv_budget(kinds)                                           # its siblings
    register_kv_demotion(kinds)


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise KvslimError(f"{name}: expected a comma list of integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise KvslimError(f"{name}: every entry must be at least 1, got {text!r}")
    return values


def config_from_args(args):
    from kvslim_lab.bench.kv_quality import KVQualityConfig, parse_settings
    try:
        depths = tuple(float(d) for d in args.passkey_depths.split(",") if d.strip())
    except ValueError:
        depths = ()
    if not depths or not all(0 <= d <= 1 for d in depths):
        raise KvslimError(f"--passkey-depths: fractions between 0 and 1, got "
                          f"{args.passkey_depths!r}")
    if min(args.max_tokens, args.passkey_tokens, args.speed_tokens, args.context) < 1 \
            or args.window < 2 or args.chunk < 1:
        raise KvslimError("--max-tokens, --passkey-tokens, --speed-tokens, --context and "
                          "--chunk must be at least 1, --window at least 2")
    return KVQualityConfig(
        models=args.model or [None], settings=parse_settings(args.settings),
        kv_cache_memory=args.kv_cache_memory, context=args.context, data=args.data,
        max_tokens=args.max_tokens, window=args.window, chunk=args.chunk,
        passkey_contexts=_ints(args.passkey_contexts, "--passkey-contexts"),
        passkey_depths=depths, passkey_tokens=args.passkey_tokens, seed=args.seed,
        speed_batches=_ints(args.speed_batches, "--speed-batches"),
        speed_tokens=args.speed_tokens, dense_check=not args.no_dense)


def run_kv_quality_cmd(args) -> int:
    from kvslim_lab.bench.kv_quality import run_kv_quality
    from kvslim_lab.bench.kv_quality_report import format_markdown, write_report
    from kvslim_lab.cli.report_command import run_bench_report
    return run_bench_report(args, config_from_args, run_kv_quality, write_report, format_markdown)
