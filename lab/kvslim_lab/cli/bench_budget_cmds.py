"""`kvslim bench kv-budget`: the KV budget compiler's plan against every uniform setting of the
same bytes (held-out KL, perplexity through the cache, passkey), per model; `kvslim bench
kv-demotion`: demotion against preemption under overload (throughput, the continuations'
perplexity), per model."""
from __future__ import annotations

from kvslim.cli.engine_args import add_threads_arg
from kvslim.errors import KvslimError


def register_kv_budget(kinds) -> None:
    p = kinds.add_parser("kv-budget", help="the KV budget compiler's per-layer plan against "
                                           "uniform settings of the same bytes")
    p.add_argument("--model", action="append", default=None,
                   help="model (repeatable; default: the embedded model, float32 import)")
    p.add_argument("--context", type=int, default=1024, help="tokens a sequence (default 1024)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="sequences whose memory the engine runs get (default 4)")
    p.add_argument("--fraction", type=float, default=0.5,
                   help="the budget, as a fraction of int8's bytes (default 0.5)")
    p.add_argument("--windows", default=None,
                   help="the plan's window choices, comma-separated (default 1/16, 1/4, 1/2 "
                        "and 3/4 of --context)")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens of a window (default 4)")
    p.add_argument("--calibration", default="../shared/corpus/valid.txt",
                   help="text the layers' sensitivity is measured on")
    p.add_argument("--calib-tokens", type=int, default=None,
                   help="tokens a calibration window (default: --context)")
    p.add_argument("--calib-batches", type=int, default=1, help="calibration windows")
    p.add_argument("--data", default="../shared/corpus/test.txt",
                   help="held-out text: KL, perplexity, passkey filler aside")
    p.add_argument("--kl-batches", type=int, default=2, help="held-out windows of --context")
    p.add_argument("--ppl-tokens", type=int, default=4096, help="perplexity: first N tokens")
    p.add_argument("--passkey-contexts", default="1024",
                   help="comma list of passkey prompt lengths")
    p.add_argument("--out", default="docs/kv_budget", help="folder of kv_budget.json/.md/.png")
    add_threads_arg(p, help="torch threads")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_kv_budget_cmd)


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise KvslimError(f"{name}: expected a comma list of positive integers, got {text!r}")
    return values


def config_from_args(args):
    from kvslim_lab.bench.kv_budget import KVBudgetConfig
    if not 0 < args.fraction <= 1:
        raise KvslimError(f"--fraction must be in (0, 1], got {args.fraction}")
    if min(args.context, args.concurrency, args.calib_tokens or 1, args.calib_batches,
           args.kl_batches, args.ppl_tokens) < 1 or args.sinks < 0:
        raise KvslimError("--context, --concurrency, --calib-tokens, --calib-batches, "
                          "--kl-batches and --ppl-tokens must be at least 1, --sinks at least 0")
    return KVBudgetConfig(
        models=args.model or [None], context=args.context, concurrency=args.concurrency,
        fraction=args.fraction, sinks=args.sinks,
        windows=_ints(args.windows, "--windows") if args.windows else None,
        calibration=args.calibration, calib_tokens=args.calib_tokens,
        calib_batches=args.calib_batches, data=args.data, kl_batches=args.kl_batches,
        ppl_tokens=args.ppl_tokens,
        passkey_contexts=_ints(args.passkey_contexts, "--passkey-contexts"))


def run_kv_budget_cmd(args) -> int:
    from kvslim_lab.bench.kv_budget import run_kv_budget
    from kvslim_lab.bench.kv_budget_report import format_markdown, write_report
    from kvslim_lab.cli.report_command import run_bench_report
    return run_bench_report(args, config_from_args, run_kv_budget, write_report, format_markdown)


def register_kv_demotion(kinds) -> None:
    p = kinds.add_parser("kv-demotion", help="demotion against preemption under overload "
                                             "(--kv-pressure demote|preempt)")
    p.add_argument("--model", action="append", default=None,
                   help="model (repeatable; default: the embedded model)")
    p.add_argument("--requests", type=int, default=16, help="requests sent at once (default 16)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens each (default 256)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="greedy tokens each (default 256)")
    p.add_argument("--overload", type=float, default=2.0,
                   help="the blocks the requests need over the blocks the pool holds (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, in turn")
    p.add_argument("--free-memory", default="2GiB", help="the unpressured run's KV memory")
    p.add_argument("--data", default="../shared/corpus/test.txt", help="the prompts' text")
    p.add_argument("--out", default="docs/kv_budget/demotion",
                   help="folder of kv_demotion.json/.md/.png")
    add_threads_arg(p, help="torch threads")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_kv_demotion_cmd)


def demotion_config_from_args(args):
    from kvslim_lab.bench.kv_demotion import KVDemotionConfig
    if min(args.requests, args.prompt, args.max_tokens, args.repeats) < 1:
        raise KvslimError("--requests, --prompt, --max-tokens and --repeats must be at least 1")
    if args.overload <= 1:
        raise KvslimError(f"--overload must be above 1 (a pool under pressure), got "
                          f"{args.overload}")
    return KVDemotionConfig(models=args.model or [None], requests=args.requests,
                            prompt_tokens=args.prompt, max_tokens=args.max_tokens,
                            overload=args.overload, repeats=args.repeats,
                            free_memory=args.free_memory, data=args.data)


def run_kv_demotion_cmd(args) -> int:
    from kvslim_lab.bench.kv_demotion import run_kv_demotion
    from kvslim_lab.bench.kv_demotion_report import format_markdown, write_report
    from kvslim_lab.cli.report_command import run_bench_report
    return run_bench_report(args, demotion_config_from_args, run_kv_demotion, write_report,
                            format_markdown)
