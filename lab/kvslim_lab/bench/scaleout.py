"""`kvslim bench serve --data-parallel-size 1 2`: `kvslim serve MODEL --data-parallel-size N`
started for each N (and, past one replica, each --routing), loaded by `kvslim bench serve`'s
client (bench/serve.py) with the same shared-prefix workload, then stopped. Each run reports
TTFT, TPOT and throughput, and the prefix-cache hit rate the replicas achieved (cached prompt
tokens over prompt tokens, from the responses' usage): the figure prefix routing is for.

One server at a time, after a short warm-up (its first steps compile and fill caches; the
warm-up's prompts share nothing with the measured ones)."""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvslim_lab.bench.machine import machine_info
from kvslim_lab.bench.peers.serving import Server
from kvslim_lab.bench.serve import ServeBenchConfig, run_serve_bench

START_TIMEOUT_S = 600.0


@dataclass
class ScaleOutPlan:
    model: str = "default"
    data_parallel_sizes: list[int] = field(default_factory=lambda: [1, 2])
    routings: list[str] = field(default_factory=lambda: ["prefix", "round-robin"])
    serve_args: list[str] = field(default_factory=list)     # more `kvslim serve` flags
    log_dir: Path = Path("runs/bench-scaleout")


def runs_of(plan: ScaleOutPlan) -> list[tuple[int, str | None]]:
    """(replicas, routing) in order; one replica has no routing to compare."""
    return [(n, routing) for n in plan.data_parallel_sizes
            for routing in (plan.routings if n > 1 else [None])]


def server_for(plan: ScaleOutPlan, replicas: int, routing: str | None) -> Server:
    name = f"dp{replicas}" + (f"-{routing}" if routing else "")

    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "kvslim.cli.main", "serve", plan.model, "--port",
                str(port), "--log-level", "warning", "--data-parallel-size", str(replicas),
                *(["--routing", routing] if routing else []), *plan.serve_args]
    return Server(name, f"kvslim serve --data-parallel-size {replicas}", argv, plan.log_dir)


def run_scaleout_bench(plan: ScaleOutPlan, load: ServeBenchConfig,
                       show_progress: bool = True) -> dict:
    """Every run's result (a failed start is reported, not raised)."""
    runs = []
    for replicas, routing in runs_of(plan):
        server = server_for(plan, replicas, routing)
        entry = {"data_parallel_size": replicas, "routing": routing or "-"}
        try:
            server.start(START_TIMEOUT_S)
            warm = replace(load, url=server.url, num_prompts=2 * replicas, output_len=4,
                           seed=load.seed + 1000, max_concurrency=None)
            run_serve_bench(warm, show_progress=False)
            # other processes' load (this machine may be shared): read before and after
            entry["load_average_1m"] = [round(os.getloadavg()[0], 2)]
            result = run_serve_bench(replace(load, url=server.url), show_progress=show_progress)
            entry["load_average_1m"].append(round(os.getloadavg()[0], 2))
            entry.update(status="ran", **result.to_dict())
            entry.pop("config")
        except Exception as e:                       # noqa: BLE001 - reported, never fatal
            entry.update(status="failed", reason=f"{type(e).__name__}: {e} "
                                                 f"(log: {server.log})")
        finally:
            server.stop()
        runs.append(entry)
    settings = asdict(load)
    settings.pop("api_key")
    settings.pop("url")
    if settings["request_rate"] == float("inf"):
        settings["request_rate"] = "inf"
    return {"command": command_of(plan, load), "machine": machine_info().to_dict(),
            "model": plan.model, "serve_args": plan.serve_args, "load": settings, "runs": runs}


def command_of(plan: ScaleOutPlan, load: ServeBenchConfig) -> str:
    """The command line that reproduces the runs."""
    parts = ["kvslim", "bench", "serve", "--data-parallel-size",
             *map(str, plan.data_parallel_sizes), "--routing", *plan.routings,
             "--serve-model", plan.model, "--num-prompts", str(load.num_prompts),
             "--input-len", str(load.input_len), "--output-len", str(load.output_len),
             "--num-prefixes", str(load.num_prefixes), "--prefix-len", str(load.prefix_len),
             "--request-rate", str(load.request_rate), "--seed", str(load.seed)]
    if load.max_concurrency:
        parts += ["--max-concurrency", str(load.max_concurrency)]
    if plan.serve_args:
        parts += ["--serve-args", shlex.join(plan.serve_args)]
    return shlex.join(parts)


def format_scaleout(report: dict) -> str:
    """A markdown table, one row per run."""
    head = ("| replicas | routing | completed | output tok/s | req/s | TTFT p50 / p99 (ms) | "
            "TPOT p50 / p99 (ms) | prefix-cache hit rate |")
    lines = [head, "|" + "---|" * 8]
    for run in report["runs"]:
        if run["status"] != "ran":
            lines.append(f"| {run['data_parallel_size']} | {run['routing']} | "
                         f"failed: {run['reason']} |||||")
            continue
        lines.append(
            f"| {run['data_parallel_size']} | {run['routing']} | {run['completed']} | "
            f"{run['output_throughput']:.1f} | {run['request_throughput']:.2f} | "
            f"{run['median_ttft_ms']:.0f} / {run['p99_ttft_ms']:.0f} | "
            f"{run['median_tpot_ms']:.1f} / {run['p99_tpot_ms']:.1f} | "
            f"{run['prefix_cache_hit_rate']:.3f} |")
    return "\n".join(lines)
