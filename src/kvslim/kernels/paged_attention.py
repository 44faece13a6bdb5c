"""Decode attention reading the paged KV cache in place: `torch.ops.kvslim.paged_decode`
(csrc/paged_attention.cpp says the arithmetic): each KV head's keys and values read once for its
group of query heads, float32, a sequence's result independent of the batch and of the tables'
padding. float32 caches, and int8 ones with their float16 scales; `supports` says which. A row
may instead read a tree's path (`tree_base`, `tree_bits`: the keys before base, then base + i for
each set bit i), the verification of a tree of drafts.

`reference_paged_decode` is the same attention in plain torch (float64), which the tests hold
the kernel to."""
from __future__ import annotations

import torch

from kvslim.kernels import extension


def supports(cache_dtype: torch.dtype | str, query_dtype: torch.dtype,
             device: torch.device) -> bool:
    """float32, int8 and the packed "int4"/"int2" caches, float32 queries, on the CPU."""
    return (device.type == "cpu" and query_dtype == torch.float32
            and cache_dtype in (torch.float32, torch.int8, "int4", "int2"))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scales: torch.Tensor | None, v_scales: torch.Tensor | None,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, key_start: int,
                 window: int | None, scale: float, tree_base: torch.Tensor | None = None,
                 tree_bits: torch.Tensor | None = None, sinks: int = 0,
                 demoted_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, Dv]: each decode over the keys before its length (and inside its
    window) of the blocks its table lists, from position `key_start` on. With tree_base and
    tree_bits [B] (int64), a row's keys from its base on are its path's (the length counts
    them: base + number of set bits). The values may be narrower than the keys (Dv <= D) and a
    view of them: DeepSeek's latent cache, whose value is its row's first entries. sinks: with
    a window, the first positions every row also sees (kv_cache/window.py). demoted_scales
    [2, 4 * blocks, block_size, kv_heads] (float16, K then V): a float32 cache's demoted blocks
    (engine/kv_demotion.py), int8 in its bytes (`demoted_view`), which a table entry e below -1
    names (block -2 - e)."""
    return torch.ops.kvslim.paged_decode(q, k_cache, v_cache, k_scales, v_scales, block_tables,
                                         context_lens, key_start, window or 0, scale,
                                         tree_base, tree_bits, sinks, demoted_scales)


def demoted_view(cache: torch.Tensor) -> torch.Tensor:
    """A float32 cache [blocks, block_size, kv_heads, head_dim] as int8 blocks of the same
    shape, four in the bytes of each float32 block (block b of the view: bytes [b n, (b + 1) n)
    for n elements a block)."""
    return cache.view(torch.int8).view(-1, *cache.shape[1:])


def reference_paged_decode(q, k_cache, v_cache, k_scales, v_scales, block_tables,
                           context_lens, key_start, window, scale, tree_base=None,
                           tree_bits=None, sinks=0, demoted_scales=None) -> torch.Tensor:
    """The kernel's attention in float64, each row's keys picked out by their positions (a
    tree row's path from its ancestor bits; a demoted block's from the int8 view)."""
    b, h, d = q.shape
    kvh, dv = k_cache.shape[2], v_cache.shape[-1]
    out = torch.zeros(b, h, dv, dtype=torch.float64)
    for i in range(b):
        keys, values = (_rows(c, s, block_tables[i], d) for c, s, d in (
            (k_cache, k_scales, None if demoted_scales is None else demoted_scales[0]),
            (v_cache, v_scales, None if demoted_scales is None else demoted_scales[1])))
        logical = torch.arange(int(context_lens[i]))
        if window:
            logical = logical[(logical >= int(context_lens[i]) - window) | (logical < sinks)]
        if tree_bits is not None and int(tree_bits[i]):
            base, bits = int(tree_base[i]), int(tree_bits[i])
            path = [base + j for j in range(64) if bits >> j & 1]
            logical = torch.tensor([p if p < base else path[p - base] for p in logical.tolist()],
                                   dtype=torch.long)
        seen = logical - key_start
        seen = seen[(seen >= 0) & (seen < keys.shape[0])]
        if not seen.numel():
            continue
        keys, values = keys[seen], values[seen]                  # [n, KVH, D]
        qi = q[i].double().view(kvh, h // kvh, d)
        scores = torch.einsum("kgd,nkd->kgn", qi, keys) * scale
        out[i] = torch.einsum("kgn,nkd->kgd", scores.softmax(-1), values).reshape(h, dv)
    return out


def _rows(cache, scales, table, demoted_scales=None):
    table = table.long()
    rows = cache[table.clamp(min=0)].double()                    # [W, BS, KVH, D]
    if scales is not None:
        rows = rows * scales[table.clamp(min=0)].double()[..., None]
    low = table < -1
    if demoted_scales is not None and low.any():
        ids = -2 - table[low]
        rows[low] = demoted_view(cache)[ids].double() * demoted_scales[ids].double()[..., None]
    return rows.flatten(0, 1)                                    # [W * BS, KVH, D]


def paged_decode_lowbit(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor,
                       k_params: torch.Tensor, v_params: torch.Tensor, recent_k: torch.Tensor,
                       recent_v: torch.Tensor, recent_start: torch.Tensor,
                       block_tables: torch.Tensor, context_lens: torch.Tensor, key_start: int,
                       window: int | None, scale: float, sinks: int, bits: int,
                       residual: int = 1) -> torch.Tensor:
    """`paged_decode` over a 4- or 2-bit cache (kernels/lowbit_codes.py's layout): each row
    reads the positions before the last `residual` blocks up to its own from the pool,
    dequantized as it goes, and those from their start on from recent_k/recent_v (float16
    [M, KVH, D], its first at recent_start[row]): the block still being filled (and the ones
    before it that are kept in float16)."""
    group = k_codes.shape[-1] * 8 // bits // v_params.shape[-1]
    return torch.ops.kvslim.paged_decode_lowbit(
        q, k_codes, v_codes, k_params, v_params, recent_k, recent_v, recent_start, block_tables,
        context_lens, key_start, window or 0, scale, sinks, bits, group, residual)


def reference_paged_decode_lowbit(q, k_codes, v_codes, k_params, v_params, recent_k, recent_v,
                                  recent_start, block_tables, context_lens, key_start, window,
                                  scale, sinks, bits, residual=1) -> torch.Tensor:
    """The low-bit kernel's attention in float64: the pool dequantized by lowbit_codes, each
    row's own block replaced by its recent rows."""
    from kvslim.kernels.lowbit_codes import dequantize_keys, dequantize_values
    keys = dequantize_keys(k_codes, k_params, bits)
    values = dequantize_values(v_codes, v_params, bits)
    bs = k_codes.shape[1]
    out = torch.zeros(*q.shape[:2], keys.shape[-1], dtype=torch.float64)
    for i in range(q.shape[0]):
        n = int(context_lens[i])
        if n <= 0:
            continue
        limit = max(0, (n - 1) // bs - residual + 1) * bs
        start = int(recent_start[i])
        k_rows, v_rows = (_rows(c, None, block_tables[i]) for c in (keys, values))
        own = range(limit - key_start, n - key_start)
        k_rows[list(own)] = recent_k[start:start + len(own)].double()
        v_rows[list(own)] = recent_v[start:start + len(own)].double()
        out[i] = reference_paged_decode(
            q[i:i + 1], k_rows.view(-1, 1, *k_rows.shape[1:]),
            v_rows.view(-1, 1, *v_rows.shape[1:]), None, None,
            torch.arange(k_rows.shape[0])[None], context_lens[i:i + 1] - key_start, 0,
            window, scale, sinks=max(0, sinks - key_start))[0]
    return out


FAKES = {"paged_decode": lambda q, k_cache, v_cache, *args: q.new_empty(*q.shape[:2],
                                                                         v_cache.shape[-1]),
         "paged_decode_lowbit": lambda q, *args: q.new_empty(q.shape)}


def available() -> bool:
    return extension.ensure(FAKES)
