"""What one more verified row costs at batch 1: the time of the model's LM head and of one
decoder layer's linear layers over M rows (M = 1 is a plain decode step's; M = k + 1 a
verification of k drafts). Best of three timings each.

    python benchmarks/verify_rows_cost.py [--model NAME] [--rows 1 2 3 4 6 8] [--threads 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kvslim import LLM


def best_ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = LLM(args.model, kv_cache_memory="64MiB").engine.model
    layer = model.model.layers[0]
    linears = {"lm_head": model.lm_head, "layer 0 qkv": layer.self_attn.qkv_proj,
               "layer 0 o": layer.self_attn.o_proj, "layer 0 gate_up": layer.mlp.gate_up_proj,
               "layer 0 down": layer.mlp.down_proj}
    dtype = next(model.parameters()).dtype
    rows = []
    with torch.inference_mode():
        for name, linear in linears.items():
            for m in args.rows:
                x = torch.randn(m, linear.in_features, dtype=dtype)
                ms = best_ms(lambda: linear(x), 5 if name == "lm_head" else 40)
                rows.append({"linear": name, "rows": m, "ms": round(ms, 3)})
    if args.json:
        print(json.dumps({"model": args.model or "default", "rows": rows}))
        return
    print("| linear | " + " | ".join(f"M={m}" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name in linears:
        cells = [f"{r['ms']:.2f}" for r in rows if r["linear"] == name]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
