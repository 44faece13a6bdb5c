"""Offline throughput and TTFT of the shipped SmolLM2 Q4_1 blocks under each attention backend:
64 random 128-token prompts, 128 new tokens each, one engine per backend in turn.

    python benchmarks/attention_offline.py [--backends kernel,gather,kernel,gather] [--threads 2]

What it backs: the cost of prefill chunks through the in-place kernel on a whole run (README's
kernels section, docs/kernels.md)."""
from __future__ import annotations

import argparse
import time

import torch

from kvslim import LLM, SamplingParams


def run(backend: str) -> tuple[float, float]:
    llm = LLM(None, attention_backend=backend, max_num_seqs=64, kv_cache_memory="1GiB")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(64)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True, temperature=0),
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft = sorted(o.metrics.time_to_first_token for o in outs)
    return 64 * 128 / seconds, ttft[len(ttft) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="kernel,gather,kernel,gather")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for backend in args.backends.split(","):
        tok_s, ttft = run(backend)
        print(f"{backend}: {tok_s:.1f} output tok/s, TTFT p50 {ttft:.2f} s", flush=True)


if __name__ == "__main__":
    main()
