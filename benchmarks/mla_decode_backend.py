"""Which paged-attention backend a latent-attention (MLA) model should decode on, on this CPU:
kvslim's C++ kernel (one KV head, the value a view of the key) against gather + SDPA, the same
model held twice and timed taking turns (`bench.latency.models_decode_speed`), at each batch.

    python benchmarks/mla_decode_backend.py MODEL_DIR... [--batches 1 32] [--input-len 128]
        [--output-len 64] [--repeats 5] [--threads 2] [--json]

MODEL_DIR: DeepSeek-V2/V3 checkpoints, e.g. `kvslim convert --to-mla` outputs (the GQA study's
runs/gqa/ref-k2-mla, ref-k1-mla, smollm2-k0.75-mla).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvslim_lab.bench.latency import models_decode_speed

BACKENDS = ("kernel", "gather")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models:
        for batch in args.batches:
            dirs = {b: Path(model) for b in BACKENDS}
            speed = models_decode_speed(dirs, args.input_len, args.output_len, args.repeats,
                                        batch=batch,
                                        options={b: {"attention_backend": b} for b in BACKENDS})
            rows.append({"model": Path(model).name, "batch": batch, "tokens_per_s": speed,
                         "kernel_over_gather": round(speed["kernel"] / speed["gather"], 3)})
    if args.json:
        print(json.dumps({"threads": args.threads, "input_len": args.input_len,
                          "output_len": args.output_len, "rows": rows}, indent=1))
        return
    print("| model | batch | kernel tok/s | gather tok/s | kernel / gather |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        s = r["tokens_per_s"]
        print(f"| {r['model']} | {r['batch']} | {s['kernel']} | {s['gather']} | "
              f"{r['kernel_over_gather']} |")


if __name__ == "__main__":
    main()
