"""Latent attention (MLA) over a cached context, absorbed or expanded: which form a prefill
chunk should take, measured on this machine.

One layer's attention for a chunk of T new tokens whose sequence holds C tokens in all (the
chunk's own included), as the engine runs it (kvslim's `grouped_sdpa`, the chunk's causal mask):
- absorbed: q_latent = q_nope W_UK per head, then multi-query attention of [q_latent; q_rope]
  over the C cached rows [c_kv; k_rope] (width kv_lora_rank + rope), the output through W_UV;
- expanded: kv_b_proj over the C cached latents gives every head's K_nope and V, then
  multi-head attention with head width nope + rope.
Absorbed reads kv_lora_rank + rope numbers per context token for every head; expanded pays
kv_b_proj over the context once, then reads nope + rope (+ v) per head. Decode (T = 1) is where
the first wins; long prefills over a wide latent (DeepSeek's 512) where the second may. Best of
five timings; `--json` for the rows, and the ratio expanded / absorbed per cell.

    python benchmarks/mla_prefill_forms.py [--chunks 1 16 64 256] [--contexts 256 1024 4096]
        [--shapes deepseek-v2-lite ref-mha-mla smollm2-mla] [--threads 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kvslim.attention.grouped import causal_mask, grouped_mask, grouped_sdpa

# name -> (heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank)
SHAPES = {
    "deepseek-v2-lite": (16, 128, 64, 128, 512),
    # kvslim convert --to-mla of the study's models (docs/gqa-uptraining.md): ref-mha at GQA-2's
    # bytes, SmolLM2 at a quarter of its bytes
    "ref-mha-mla": (8, 32, 64, 32, 64),
    "smollm2-mla": (9, 64, 48, 64, 48),
}


def best_ms(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def forms(shape, chunk: int, context: int, dtype: torch.dtype):
    """(absorbed, expanded): callables computing the chunk's [T, H, v] output both ways."""
    h, nope, rope, vd, rank = shape
    g = torch.Generator().manual_seed(0)
    q_nope, q_rope = (torch.randn(chunk, h, d, generator=g, dtype=dtype) for d in (nope, rope))
    rows = torch.randn(context, 1, rank + rope, generator=g, dtype=dtype)
    kv_b = torch.randn(h * (nope + vd), rank, generator=g, dtype=dtype) / rank ** 0.5
    w = kv_b.view(h, nope + vd, rank)
    w_uk, w_uv_t = w[:, :nope].contiguous(), w[:, nope:].transpose(1, 2).contiguous()
    allowed = causal_mask(chunk, context, q_nope.device)[None]
    scale = (nope + rope) ** -0.5
    mask_mqa, mask_mha = grouped_mask(allowed, h, dtype), grouped_mask(allowed, 1, dtype)

    def absorbed():
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q = torch.cat((q_latent, q_rope), dim=-1)
        out = grouped_sdpa(q[None], rows[None], rows[None, ..., :rank], mask_mqa, scale)[0]
        return torch.bmm(out.transpose(0, 1), w_uv_t).transpose(0, 1)

    def expanded():
        kv = torch.nn.functional.linear(rows[:, 0, :rank], kv_b).view(context, h, nope + vd)
        k_nope, v = kv.split([nope, vd], dim=-1)
        k = torch.cat((k_nope, rows[:, :, rank:].expand(context, h, rope)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return grouped_sdpa(q[None], k[None], v[None], mask_mha, scale)[0]

    return absorbed, expanded


def measure(shapes, chunks, contexts, dtype) -> list[dict]:
    out = []
    with torch.inference_mode():
        for name in shapes:
            for context in contexts:
                for chunk in (c for c in chunks if c <= context):
                    absorbed, expanded = forms(SHAPES[name], chunk, context, dtype)
                    diff = (absorbed() - expanded()).abs().max().item()
                    a, e = best_ms(absorbed), best_ms(expanded)
                    out.append({"shape": name, "chunk": chunk, "context": context,
                                "absorbed_ms": round(a, 3), "expanded_ms": round(e, 3),
                                "expanded_over_absorbed": round(e / a, 3),
                                "max_abs_diff": diff})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure(args.shapes, args.chunks, args.contexts, getattr(torch, args.dtype))
    if args.json:
        print(json.dumps({"dtype": args.dtype, "threads": args.threads, "rows": rows}, indent=1))
        return
    print("| shape | chunk | context | absorbed ms | expanded ms | expanded / absorbed |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['chunk']} | {r['context']} | {r['absorbed_ms']} | "
              f"{r['expanded_ms']} | {r['expanded_over_absorbed']} |")


if __name__ == "__main__":
    main()
