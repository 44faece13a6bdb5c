"""Decode attention per KV-cache dtype: kvslim's paged decode kernel over a float32, int8, int4
and int2 pool (the packed ones as the engine lays them out, attention/lowbit_cache.py), one
layer of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64), at batch 1 and 32 and a few
contexts. It answers whether the 4- and 2-bit caches, which read fewer bytes, attend at least
as fast as int8 (the KV cache at 4 and 2 bits, speed goal).

    python benchmarks/kv_lowbit_attention.py [--contexts 1024,4096] [--batches 1,32]
        [--rounds 20] [--threads N] [--json] [--out docs/kv_lowbit_attention.json]"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvslim.kernels import paged_attention
from kvslim.kernels.lowbit_codes import (RESIDUAL_BLOCKS, quantize_key_blocks,
                                         quantize_value_blocks)
from kvslim.kv_cache.plan import DEFAULT_BLOCK_SIZE, PACKED_BLOCK_SIZE

H, KVH, D = 9, 3, 64


def pool(dtype: str, blocks: int, bs: int, g: torch.Generator):
    k = torch.randn(blocks, bs, KVH, D, generator=g)
    v = torch.randn(blocks, bs, KVH, D, generator=g)
    if dtype == "float32":
        return k, v, None, None
    if dtype == "int8":
        ks, vs = (x.abs().amax(-1) / 127 for x in (k, v))
        return ((k / ks[..., None]).round().to(torch.int8), (v / vs[..., None]).round().to(
            torch.int8), ks.half(), vs.half())
    bits = int(dtype.removeprefix("int"))
    kc, kp = quantize_key_blocks(k, bits)
    vc, vp = quantize_value_blocks(v, bits)
    return kc, vc, kp, vp


def step(dtype: str, batch: int, context: int, g: torch.Generator):
    """The kernel's arguments for `batch` decodes of `context` tokens each (own tables)."""
    bs = PACKED_BLOCK_SIZE if dtype in ("int4", "int2") else DEFAULT_BLOCK_SIZE
    per_seq = -(-context // bs)
    cache = pool(dtype, batch * per_seq + 1, bs, g)
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, H, D, generator=g)
    if dtype not in ("int4", "int2"):
        return lambda: paged_attention.paged_decode(q, *cache, tables, lens, 0, None, 0.125)
    bits = int(dtype.removeprefix("int"))
    residual = RESIDUAL_BLOCKS[bits]          # the engine's: its float16 blocks per sequence
    own = context - max(0, (context - 1) // bs - residual + 1) * bs
    recent = [torch.randn(batch * own, KVH, D, generator=g).half() for _ in range(2)]
    starts = torch.arange(batch) * own
    return lambda: paged_attention.paged_decode_lowbit(q, *cache, *recent, starts, tables, lens,
                                                      0, None, 0.125, 0, bits, residual)


def measure(dtypes, batches, contexts, rounds: int) -> list[dict]:
    """Each cell the median of `rounds`, the dtypes interleaved in every round (A B C D A B C
    D ...), so a shared machine's slow spell falls on all of them alike."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for context in contexts:
        for batch in batches:
            runs = {dtype: step(dtype, batch, context, g) for dtype in dtypes}
            times = {dtype: [] for dtype in dtypes}
            for run in runs.values():
                run()
            for _ in range(rounds):
                for dtype, run in runs.items():
                    t = time.perf_counter()
                    run()
                    times[dtype].append(time.perf_counter() - t)
            for dtype in dtypes:
                ms = statistics.median(times[dtype]) * 1e3
                rows.append({"dtype": dtype, "batch": batch, "context": context,
                             "ms": round(ms, 4), "us_per_token": round(ms * 1e3 / batch, 2)})
                print(f"context {context:>5}  batch {batch:>3}  {dtype:>7}: {ms:8.3f} ms "
                      f"({ms * 1e3 / batch:8.1f} us a sequence)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,int8,int4,int2")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert paged_attention.available(), "kvslim's kernels did not build"
    rows = measure(args.dtypes.split(","), [int(b) for b in args.batches.split(",")],
                   [int(c) for c in args.contexts.split(",")], args.rounds)
    out = {"shape": {"heads": H, "kv_heads": KVH, "head_dim": D},
           "threads": torch.get_num_threads(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
