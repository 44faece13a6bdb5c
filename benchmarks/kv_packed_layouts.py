"""Which layout the packed (int4/int2) KV cache takes: block size (the keys' per-channel run and
the float16 block being filled) and the values' group, measured through the engine's cache.

Perplexity on the first N tokens of the shared test split (windows of 512, prefilled in chunks
of 64, so every chunk attends to quantized blocks), SmolLM2-135M-Instruct's float32 import, and
the KV bytes per token each layout stores (the pool's; the float16 residual is per sequence).
The choice it made: blocks of 64 and value groups of 64 (kv_cache/plan.py PACKED_BLOCK_SIZE,
kernels/lowbit_codes.py VALUE_GROUP), and for int2 a residual of two blocks (RESIDUAL_BLOCKS).

    python benchmarks/kv_packed_layouts.py [--max-tokens 4096] [--out docs/kv_packed_layouts.json]"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import kvslim.kernels.lowbit_codes as codes
from kvslim.formats.registry import engine_model_dir
from kvslim_lab.bench.kv_quality import (KVQualityConfig, KVSetting, _corpus, build_llm,
                                         cache_perplexity)

# name -> (engine options, the values' group, int2's residual in blocks)
INT2 = {"kv_cache_dtype": "int2", "block_size": 64}
LAYOUTS = {
    "float": ({}, 64, 1),
    "int8": ({"kv_cache_dtype": "int8"}, 64, 1),
    "int4 bs16 g32": ({"kv_cache_dtype": "int4", "block_size": 16}, 32, 1),
    "int4 bs64 g64": ({"kv_cache_dtype": "int4", "block_size": 64}, 64, 1),
    "int4 bs32 g64": ({"kv_cache_dtype": "int4", "block_size": 32}, 64, 1),
    "int2 bs16 g32": ({"kv_cache_dtype": "int2", "block_size": 16}, 32, 1),
    "int2 bs64 g64": (INT2, 64, 1),
    "int2 bs64 g64 rot": ({**INT2, "kv_hadamard": True}, 64, 1),
    "int2 bs64 g64 residual 2": (INT2, 64, 2),
    "int2 bs64 g64 rot residual 2": ({**INT2, "kv_hadamard": True}, 64, 2),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model_dir = engine_model_dir(None, "float32", False)
    tokens = _corpus(model_dir, KVQualityConfig(max_tokens=args.max_tokens))
    out = {}
    default_group, default_residual = codes.VALUE_GROUP, codes.RESIDUAL_BLOCKS[2]
    for name, (options, group, residual) in LAYOUTS.items():
        codes.VALUE_GROUP, codes.RESIDUAL_BLOCKS[2] = group, residual
        try:
            start = time.time()
            llm = build_llm(model_dir, KVSetting(name, options), "1GiB", 64, 8)
            ppl, _ = cache_perplexity(llm, tokens, 512)
            out[name] = {"ppl": ppl, "bytes_per_token": llm.engine.kv_cache_stats().bytes_per_token}
            llm.shutdown()
        finally:
            codes.VALUE_GROUP, codes.RESIDUAL_BLOCKS[2] = default_group, default_residual
        print(name, out[name], f"{time.time() - start:.0f} s", flush=True)
    base = out["float"]["ppl"]
    for r in out.values():
        r["vs_float"] = round(r["ppl"] / base - 1, 5)
    text = json.dumps({"max_tokens": args.max_tokens, "layouts": out}, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
