"""Decode speed on CPU cores that another process is also using, by thread count and how
idle threads wait (OMP_WAIT_POLICY, GOMP_SPINCOUNT), and whether a native call holds torch's
threads for its whole length (kvslim's default, csrc/thread_team.h) or splits each kernel over
OpenMP anew (KVSLIM_THREAD_TEAM=0). Each cell runs in a fresh interpreter, because both settings
are read once.

The workload is a decode step of SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536,
batch 1): matrix-vector products, the many small ops that make a step latency-bound.
The competing load is `busy` single-threaded spin loops (each ends after --max-load-s).

    python benchmarks/shared_cores.py            # a table
    python benchmarks/shared_cores.py --json     # the same rows as JSON
    python benchmarks/shared_cores.py --model DIR   # kvslim's engine, greedy decode
    python benchmarks/shared_cores.py --model DIR --batch 1 32 --busy 0 1 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import sys, time, torch
threads, steps = int(sys.argv[1]), int(sys.argv[2])
if threads:
    torch.set_num_threads(threads)
torch.manual_seed(0)
layers = [(torch.randn(576 * 3 // 2, 576), torch.randn(576, 576), torch.randn(2 * 1536, 576),
           torch.randn(576, 1536)) for _ in range(30)]
x = torch.randn(1, 576)
def step(x):
    for qkv, o, up, down in layers:
        h = x @ qkv.T
        x = x + h[:, :576] @ o.T
        g = x @ up.T
        x = x + (torch.nn.functional.silu(g[:, :1536]) * g[:, 1536:]) @ down.T
        x = x / x.norm()
    return x
with torch.inference_mode():
    for _ in range(3):
        step(x)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - t)
times.sort()
print(times[len(times) // 2], torch.get_num_threads())
"""


ENGINE_WORKER = r"""
import sys, time, torch
threads, steps, model, batch = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
if threads:
    torch.set_num_threads(threads)
from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams
llm = LLM(model, kv_cache_memory="256MiB", max_num_seqs=max(1, batch))
params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
prompts = [f"{i}. The capital of France is" for i in range(batch)]
llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
per_step = (time.perf_counter() - start) / steps if batch > 1 else \
    outs[0].metrics.time_per_output_token
print(per_step, torch.get_num_threads())
"""

# How idle threads wait, each kernel splitting over OpenMP anew (KVSLIM_THREAD_TEAM=0): "unset"
# (libgomp spins a while, then sleeps), "PASSIVE" (sleep at once), "ACTIVE" (spin), or
# "spin=N" (unset, GOMP_SPINCOUNT=N iterations); "team": kvslim's default, a native call
# holding the threads for its length, with the CLI's GOMP_SPINCOUNT=1000 between calls.
WAITS = ("unset", "PASSIVE", "spin=1000", "team")


def wait_env(wait: str) -> dict:
    env = dict(os.environ)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(name, None)
    env["KVSLIM_THREAD_TEAM"] = "0"
    if wait == "team":
        env.pop("KVSLIM_THREAD_TEAM")
        env["GOMP_SPINCOUNT"] = "1000"
    elif wait.startswith("spin="):
        env["GOMP_SPINCOUNT"] = wait.removeprefix("spin=")
    elif wait != "unset":
        env["OMP_WAIT_POLICY"] = wait
    return env


def measure(threads: int, wait: str, busy: int, steps: int, max_load_s: int,
            model: str | None = None, batch: int = 1) -> dict:
    load = [subprocess.Popen(["timeout", str(max_load_s), sys.executable, "-c",
                              "while True: pass"]) for _ in range(busy)]
    try:
        worker = [ENGINE_WORKER, str(threads), str(steps), model, str(batch)] if model else \
            [WORKER, str(threads), str(steps)]
        out = subprocess.run([sys.executable, "-c", *worker], env=wait_env(wait),
                             capture_output=True, text=True, timeout=max_load_s, check=True)
    finally:
        for p in load:
            p.terminate()
            p.wait()
    median, used = out.stdout.split()
    return {"threads": int(used), "wait": wait, "busy_processes": busy, "batch": batch,
            "ms_per_step": round(float(median) * 1e3, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    p.add_argument("--busy", type=int, nargs="+", default=[0, 1],
                   help="competing spin loops per row")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-load-s", type=int, default=120)
    p.add_argument("--model", help="time kvslim's engine on this model directory instead of "
                                   "the synthetic decode step")
    p.add_argument("--batch", type=int, nargs="+", default=[1],
                   help="with --model: sequences decoded together (>1: wall time per step)")
    p.add_argument("--waits", nargs="+", default=list(WAITS),
                   help="unset, PASSIVE, ACTIVE, spin=N (GOMP_SPINCOUNT) or team")
    p.add_argument("--rounds", type=int, default=1, help="turns over the grid (medians)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    cells = [(t, wait, busy, batch) for batch in args.batch for busy in args.busy
             for t in dict.fromkeys(args.threads) for wait in args.waits]
    # Rounds take turns over the whole grid, so a slow minute of a shared host lands on every
    # cell alike; each cell's median is reported.
    runs: dict = {cell: [] for cell in cells}
    for _ in range(args.rounds):
        for t, wait, busy, batch in cells:
            runs[(t, wait, busy, batch)].append(
                measure(t, wait, busy, args.steps, args.max_load_s, args.model, batch))
    rows = [dict(r[0], ms_per_step=statistics.median(x["ms_per_step"] for x in r))
            for r in runs.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"cpus: {os.cpu_count()}, affinity: {len(os.sched_getaffinity(0))}, "
          f"load average: {os.getloadavg()[0]:.2f}")
    print(f"{'batch':>5} {'busy':>4} {'threads':>7} {'wait':>11} {'ms/step':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['busy_processes']:>4} {r['threads']:>7} {r['wait']:>11} "
              f"{r['ms_per_step']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
