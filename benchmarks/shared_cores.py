"""Decode speed on CPU cores that another process is also using, by thread count and
OMP_WAIT_POLICY. Each cell runs in a fresh interpreter, because OpenMP reads OMP_WAIT_POLICY
only when torch is imported.

The workload is a decode step of SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536,
batch 1): matrix-vector products, the many small ops that make a step latency-bound.
The competing load is `busy` single-threaded spin loops (each ends after --max-load-s).

    python benchmarks/shared_cores.py            # a table
    python benchmarks/shared_cores.py --json     # the same rows as JSON
    python benchmarks/shared_cores.py --model DIR   # kvslim's engine, greedy decode
"""
from __future__ import annotations

import argparse
import json
import os
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
import sys, torch
threads, steps, model = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if threads:
    torch.set_num_threads(threads)
from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams
llm = LLM(model, kv_cache_memory="64MiB", max_num_seqs=1)
params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
print(out.metrics.time_per_output_token, torch.get_num_threads())
"""


def measure(threads: int, policy: str | None, busy: int, steps: int, max_load_s: int,
            model: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    load = [subprocess.Popen(["timeout", str(max_load_s), sys.executable, "-c",
                              "while True: pass"]) for _ in range(busy)]
    try:
        worker = [ENGINE_WORKER, str(threads), str(steps), model] if model else \
            [WORKER, str(threads), str(steps)]
        out = subprocess.run([sys.executable, "-c", *worker], env=env,
                             capture_output=True, text=True, timeout=max_load_s, check=True)
    finally:
        for p in load:
            p.terminate()
            p.wait()
    median, used = out.stdout.split()
    return {"threads": int(used), "omp_wait_policy": policy or "unset", "busy_processes": busy,
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
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = [measure(t, policy, busy, args.steps, args.max_load_s, args.model)
            for busy in args.busy for t in dict.fromkeys(args.threads)
            for policy in (None, "PASSIVE")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"cpus: {os.cpu_count()}, affinity: {len(os.sched_getaffinity(0))}, "
          f"load average: {os.getloadavg()[0]:.2f}")
    print(f"{'busy':>4} {'threads':>7} {'OMP_WAIT_POLICY':>15} {'ms/step':>9}")
    for r in rows:
        print(f"{r['busy_processes']:>4} {r['threads']:>7} {r['omp_wait_policy']:>15} "
              f"{r['ms_per_step']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
