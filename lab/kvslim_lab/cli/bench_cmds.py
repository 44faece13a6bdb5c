"""`kvslim bench <kind>`: one sub-command per benchmark — throughput, latency, capacity, profile,
serve (load against a running server), kernels (linear kernels for quantized weights), peers
(every peer at its best in one run), report (docs/benchmarks.md, around the peers run) and
kv-quality (KV-cache settings: capacity, perplexity through the cache, passkey, speed)."""
from __future__ import annotations

import json
import os


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, capacity, report, "
                                         "serve, kernels, peers, kv-quality")
    kinds = bench.add_subparsers(dest="bench_command", metavar="KIND", required=True)
    from kvslim_lab.cli.bench_engine_cmds import register_engine_benchmarks
    register_engine_benchmarks(kinds)
    from kvslim_lab.cli.bench_peers_cmds import register_peers
    register_peers(kinds)
    from kvslim_lab.cli.bench_report_cmds import register_report
    register_report(kinds)
    from kvslim_lab.cli.bench_quality_cmds import register_kv_quality
    register_kv_quality(kinds)
    _register_serve(kinds)


def _register_serve(kinds) -> None:
    p = kinds.add_parser("serve", help="streaming load against an OpenAI-compatible server "
                                       "(TTFT, TPOT, ITL, throughput)")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no cap)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prefixes", type=int, default=0,
                   help="prompts start with one of this many shared prefixes (default 0: "
                        "none), so that prefix caches and prefix routing matter")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens of each shared prefix")
    g = p.add_argument_group("replicas: start the servers here instead of --url")
    g.add_argument("--data-parallel-size", type=int, nargs="+", default=None, metavar="N",
                   help="run `kvslim serve SERVE_MODEL --data-parallel-size N` for each N in "
                        "turn and load each (docs/scale-out.md)")
    g.add_argument("--routing", nargs="+", default=["prefix", "round-robin"],
                   choices=["prefix", "least-loaded", "round-robin"],
                   help="with more than one replica, one run per policy (default: prefix "
                        "round-robin)")
    g.add_argument("--serve-model", default="default",
                   help="the model the servers load (default: the embedded SmolLM2)")
    g.add_argument("--serve-args", default="",
                   help="more `kvslim serve` flags, one string (e.g. \"--kv-cache-memory 256MiB\")")
    g.add_argument("--output", default=None, help="write the runs as JSON here")
    p.add_argument("--api-key", default=os.environ.get("KVSLIM_API_KEY")
                   or os.environ.get("OPENAI_API_KEY"),
                   help="bearer key (default: $KVSLIM_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench_serve)


def run_bench_serve(args) -> int:
    from kvslim_lab.bench.serve import ServeBenchConfig, format_result, run_serve_bench
    config = ServeBenchConfig(
        url=args.url, num_prompts=args.num_prompts, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, input_len=args.input_len,
        output_len=args.output_len, model=args.model, api_key=args.api_key, seed=args.seed,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len)
    if args.data_parallel_size:
        return _bench_replicas(args, config)
    result = run_serve_bench(config, show_progress=not args.no_progress)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_result(result))
    return 0 if result.completed else 1


def _bench_replicas(args, config) -> int:
    import shlex
    from pathlib import Path

    from kvslim.errors import KvslimError
    from kvslim_lab.bench.scaleout import ScaleOutPlan, format_scaleout, run_scaleout_bench
    if any(n < 1 for n in args.data_parallel_size):
        raise KvslimError("--data-parallel-size must be at least 1")
    plan = ScaleOutPlan(args.serve_model, args.data_parallel_size, args.routing,
                        shlex.split(args.serve_args))
    report = run_scaleout_bench(plan, config, show_progress=not args.no_progress)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2) if args.json else format_scaleout(report))
    return 0 if all(run["status"] == "ran" for run in report["runs"]) else 1
