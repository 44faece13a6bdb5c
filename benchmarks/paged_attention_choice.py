"""Which paged-attention backend the CPU should default to, measured: the gather path against
FlexAttention (eager on the CPU) and kvslim's C++ decode kernel (`kernel`: decodes read the
cache in place; prefill chunks gather) on the same steps, one model's attention shape.

    python benchmarks/paged_attention_choice.py [--backends gather,flex,kernel] [--layers 30] \
        [--repeats 3] [--threads N] [--json] [--out docs/paged_attention_choice.json]

A step is what the engine does for one layer's worth of attention, amortised over `--layers`
layers: the step's metadata built once (`build_paged_attention`, masks included), then every
layer's attention call, divided by the layer count. Shapes: decode batches of 1, 8 and 32 at
contexts of 256 and 1024 tokens, and one prefill chunk of 256 tokens after 768 cached ones.
Each sequence's blocks are shuffled over a pool that holds exactly the step's blocks (times
`--pool-factor`): FlexAttention's eager path scores every slot of the pool, so a larger pool,
as a real cache is, only makes it slower. Defaults: SmolLM2-135M's attention (9 query heads over
3 KV heads, head_dim 64, 30 layers), float32, blocks of 16.

Prints a table and the backend that is faster on the sum of the shapes' times (the CPU default
in `kvslim.attention.backends` comes from this); --json prints the raw numbers as JSON."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvslim.attention import KVCacheLayer, PagedStepLayout, PrefillChunk, build_paged_attention
from kvslim_lab.bench.attention_report import cpu_table
from kvslim_lab.bench.machine import machine_info

SHAPES = [("decode", b, ctx, 1) for ctx in (256, 1024) for b in (1, 8, 32)] \
    + [("prefill", 1, 1024, 256)]           # kind, sequences, context after the step, new


def random_step(kind: str, num_seqs: int, context: int, new: int, args, seed: int = 0):
    """The pool [K/V, blocks, block_size, KVH, D], the step's layout and its q, k, v."""
    g = torch.Generator().manual_seed(seed)
    bs = args.block_size
    per_seq = -(-context // bs)
    pool = num_seqs * per_seq * args.pool_factor + 1
    perm = torch.randperm(pool, generator=g)
    tables = perm[:num_seqs * per_seq].view(num_seqs, per_seq)
    positions = torch.arange(context - new, context)
    slots = (tables[:, positions // bs] * bs + positions % bs).reshape(-1)
    if kind == "decode":
        layout = PagedStepLayout(slot_mapping=slots, num_decode_tokens=num_seqs,
                                 decode_block_tables=tables,
                                 decode_context_lens=torch.full((num_seqs,), context))
    else:
        layout = PagedStepLayout(slot_mapping=slots, prefills=[PrefillChunk(
            query_start=0, query_len=new, context_len=context, block_table=tables[0])])
    n = slots.shape[0]
    kv = torch.randn(2, pool, bs, args.kv_heads, args.head_dim, generator=g)
    q = torch.randn(n, args.heads, args.head_dim, generator=g)
    k, v = (torch.randn(n, args.kv_heads, args.head_dim, generator=g) for _ in range(2))
    return kv, layout, q, k, v


def step_ms(backend: str, kv, layout, q, k, v, layers: int, repeats: int) -> float:
    """Median over `repeats` of (metadata + `layers` attention calls) / layers, in ms; two
    untimed steps first (FlexAttention traces its call on the first)."""
    caches = [KVCacheLayer(kv[0], kv[1])] * layers       # one pool read by every layer
    scale = q.shape[-1] ** -0.5

    def one_step() -> float:
        start = time.perf_counter()
        attn = build_paged_attention(backend, caches, layout, [None] * layers)
        for layer in range(layers):
            attn.attend(layer, q, k, v, scale)
        return (time.perf_counter() - start) * 1e3 / layers
    with torch.inference_mode():
        for _ in range(2):
            one_step()
        return statistics.median(one_step() for _ in range(repeats))


def measure(args) -> dict:
    rows, backends = [], args.backends.split(",")
    for kind, num_seqs, context, new in SHAPES:
        step = random_step(kind, num_seqs, context, new, args)
        times = {b: step_ms(b, *step, args.layers, args.repeats) for b in backends}
        rows.append(dict(kind=kind, sequences=num_seqs, context=context, new_tokens=new,
                         pool_blocks=step[0].shape[1],
                         **{f"{b}_ms": round(t, 3) for b, t in times.items()}))
        print(f"[choice] {kind} x{num_seqs} @{context}: "
              + ", ".join(f"{b} {t:.2f} ms" for b, t in times.items()), file=sys.stderr,
              flush=True)
    totals = {b: sum(r[f"{b}_ms"] for r in rows) for b in backends}
    return dict(command="python benchmarks/paged_attention_choice.py " + " ".join(sys.argv[1:]),
                machine=machine_info().to_dict(), backends=backends,
                shape=dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                           block_size=args.block_size, layers=args.layers, dtype="float32",
                           pool_factor=args.pool_factor, repeats=args.repeats),
                results=rows, choice=min(totals, key=totals.get))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="gather,flex,kernel")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--pool-factor", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args)
    print(json.dumps(result, indent=2) if args.json else cpu_table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
