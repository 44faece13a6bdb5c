"""Uptraining throughput, eager against a compiled step (`kvslim uptrain --compile-step`):
the same steps of `kvslim uptrain`'s loop on each model, tokens/s from its train_log.jsonl.

    python benchmarks/train_compile.py MODEL_DIR... --data ../shared/corpus/train.txt
        [--steps 12] [--log-every 4] [--batch-size 16] [--seq-len 256] [--threads 2] [--json]

For each model and mode: the first logged window (the compiled step's compilation falls there),
the median of the later windows (the steady rate), and the whole run's wall time. Whether
`--compile-step` pays on a run of N steps follows from the two: compilation seconds against the
steady gain per step. MODEL_DIR: any model `kvslim uptrain` takes (ref-mha, a GQA or MLA
conversion, SmolLM2's import)."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvslim.train.train_config import TrainConfig
from kvslim.train.trainer import LOG_FILE, train


def run(model: str, data: str, compiled: bool, args) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(data=data, out=out, init_from=model, seq_len=args.seq_len,
                          steps=args.steps, batch_size=args.batch_size, lr=2e-4,
                          warmup_steps=1, eval_every=args.steps, save_every=args.steps,
                          log_every=args.log_every, threads=args.threads,
                          compile_step=compiled)
        start = time.perf_counter()
        train(cfg, show_progress=False)
        wall = time.perf_counter() - start
        rates = [r["tokens_per_s"] for r in map(json.loads, (Path(out) / LOG_FILE).open())
                 if "tokens_per_s" in r]
    return {"model": Path(model).name, "compiled": compiled, "first_window_tok_s": rates[0],
            "steady_tok_s": statistics.median(rates[1:]) if len(rates) > 1 else None,
            "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--data", required=True, help="training text")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [run(m, args.data, compiled, args) for m in args.models for compiled in (False, True)]
    if args.json:
        print(json.dumps({"steps": args.steps, "log_every": args.log_every,
                          "batch_size": args.batch_size, "seq_len": args.seq_len,
                          "threads": args.threads, "rows": rows}, indent=1))
        return
    print("| model | step | first window tok/s | steady tok/s | wall s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {'compiled' if r['compiled'] else 'eager'} | "
              f"{r['first_window_tok_s']} | {r['steady_tok_s']} | {r['wall_s']} |")


if __name__ == "__main__":
    main()
