"""Perplexity of the default int8 activations against float32 activations and against
llama.cpp's own perplexity, on the same GGUF files and the same windows of the shared test split.

kvslim runs each file kept in its blocks (the engine's kernels chosen as the engine chooses
them, kernels/activations.py); llama-perplexity runs the file itself, on windows of `--context`
tokens every `--context - 1` (its strided mode cannot step a whole window), which kvslim's
sliding windows reproduce exactly (bench/llamacpp_tools.py). The default is acceptable where
its change from float32 is no worse than llama.cpp's distance from kvslim's float32 reference.

    python benchmarks/activation_ppl.py [--models smollm2 gemma3] [--windows 16] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kvslim_lab.bench.llamacpp_tools import DEFAULT_BIN, LlamaCppTools
from kvslim.eval.perplexity import file_perplexity
from kvslim.formats import registry

MODELS = {"smollm2": registry.default_model_gguf, "gemma3": registry.gemma3_gguf}


def measure(name: str, test: Path, context: int, windows: int, tools: LlamaCppTools) -> dict:
    gguf = MODELS[name]()
    kept = registry.imported_gguf_dir(gguf, show_progress=False, quantized=True)
    stride = context - 1
    tokens = context + (windows - 1) * stride
    row = {"model": name, "file": gguf.name, "windows": f"{windows} x {context}, stride {stride}"}
    for kind in ("float32", "int8"):
        r = file_perplexity(kept, test, context, stride, tokens, show_progress=False,
                            linear_activations=kind)
        row[f"kvslim_{kind}"] = round(r.perplexity, 4)
    row["llamacpp"] = round(tools.perplexity(gguf, test, context, stride, windows)[0], 4)
    ref = row["kvslim_float32"]
    row["int8_change_pct"] = round(100 * (row["kvslim_int8"] / ref - 1), 3)
    row["llamacpp_change_pct"] = round(100 * (row["llamacpp"] / ref - 1), 3)
    row["int8_no_worse"] = row["kvslim_int8"] <= row["llamacpp"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--test", type=Path, default=Path(__file__).resolve().parents[2] /
                    "shared" / "corpus" / "test.txt")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--llamacpp-bin", type=Path, default=Path(DEFAULT_BIN))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tools = LlamaCppTools(args.llamacpp_bin, args.threads)
    if tools.missing():
        raise SystemExit(tools.missing())
    rows = [measure(m, args.test, args.context, args.windows, tools) for m in args.models]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| model | file | windows | kvslim float32 | kvslim int8 (default) | llama.cpp | "
          "int8 vs float32 | llama.cpp vs float32 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['file']} | {r['windows']} | {r['kvslim_float32']:.3f} | "
              f"{r['kvslim_int8']:.3f} | {r['llamacpp']:.3f} | {r['int8_change_pct']:+.2f}% | "
              f"{r['llamacpp_change_pct']:+.2f}% |")


if __name__ == "__main__":
    main()
