"""Perplexity of several models on the same text, comparable across tokenizers.

Per-token perplexity depends on the tokenizer (Gemma 3's 262k vocabulary makes fewer, harder
tokens than SmolLM2's 49k), so each model scores the very same bytes — the first --bytes of the
file, cut at a line end — and the report adds bits per byte: the summed NLL over those bytes.

    python benchmarks/model_ppl.py --models SmolLM2-135M-Instruct gemma3-270m \
        --data ../shared/corpus/test.txt --bytes 40000 [--linear-activations float32 int8] --json

--linear-activations scores each model once per choice through the engine's kernels
(kernels/activations.py: int8 is llama.cpp's rounding of the activations); without it, the
weights as loaded, dequantized, in float32.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from kvslim.eval.perplexity import file_perplexity
from kvslim.formats.registry import resolve_model


def cut_text(path: Path, num_bytes: int) -> str:
    text = path.read_bytes()[:num_bytes].decode("utf-8", errors="ignore")
    return text[:text.rfind("\n") + 1] or text


def measure(models: list[str], data: Path, num_bytes: int, context: int, stride: int,
            activations: list[str | None] = (None,)) -> dict:
    text = cut_text(data, num_bytes)
    size = len(text.encode("utf-8"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sample = Path(tmp) / "sample.txt"
        sample.write_text(text)
        for name, kind in itertools.product(models, activations):
            start = time.perf_counter()
            r = file_perplexity(resolve_model(name, show_progress=False), sample, context,
                                stride, show_progress=False, linear_activations=kind)
            rows.append({"model": name, "linear_activations": kind,
                         "perplexity": round(r.perplexity, 3),
                         "tokens": r.num_tokens, "bytes": size,
                         "bits_per_byte": round(r.nll * r.num_tokens / size / math.log(2), 4),
                         "seconds": round(time.perf_counter() - start, 1)})
    return {"data": str(data), "bytes": size, "context": context, "stride": stride,
            "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"Same {result['bytes']:,} bytes of `{result['data']}`, windows of "
             f"{result['context']} tokens, stride {result['stride']}:", "",
             "| model | activations | tokens | perplexity per token | bits per byte |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r.get('linear_activations') or 'dequantized'} | "
              f"{r['tokens']:,} | {r['perplexity']:.3f} | "
              f"{r['bits_per_byte']:.4f} |" for r in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["SmolLM2-135M-Instruct", "gemma3-270m"])
    p.add_argument("--data", type=Path, default=Path("../shared/corpus/test.txt"))
    p.add_argument("--bytes", type=int, default=40_000)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--linear-activations", nargs="+", choices=("float32", "int8"),
                   default=[None])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = measure(args.models, args.data, args.bytes, args.context, args.stride,
                     args.linear_activations)
    print(json.dumps(result, indent=1) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
