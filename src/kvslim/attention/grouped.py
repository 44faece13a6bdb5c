"""Grouped-query attention without copying K/V per query head.

The G query heads that share one KV head are folded into the query-length axis:
q [B, Tq, H, D] -> [B, KVH, G*Tq, D]. One scaled-dot-product call then attends every row of a
group to the same K/V tensor [B, KVH, Tk, D] (a strided view of the cache or of the projection)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None, scale: float, causal: bool = True) -> torch.Tensor:
    """q [B, Tq, H, D]; k, v [B, Tk, KVH, D]; mask from `grouped_mask` ([B or 1, 1, G*Tq, Tk]
    additive), or None for plain causal attention with Tq == Tk (or, with causal=False, for
    queries that see every key). v may be narrower than q and k (MLA's latent value, Dv).
    Returns [B, Tq, H, Dv]."""
    b, tq, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    qg = q.view(b, tq, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * tq, d)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    if mask is None and not causal:
        out = F.scaled_dot_product_attention(qg, kt, vt, scale=scale)
    elif mask is None and g == 1:
        out = F.scaled_dot_product_attention(qg, kt, vt, is_causal=True, scale=scale)
    else:
        if mask is None:
            mask = grouped_mask(causal_mask(tq, tq, q.device)[None], g, q.dtype)
        out = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask, scale=scale)
    dv = v.shape[-1]
    return out.view(b, kvh, g, tq, dv).permute(0, 3, 1, 2, 4).reshape(b, tq, h, dv)


def grouped_mask(allowed: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, Tq, Tk] (True = may attend) -> the additive [B, 1, group*Tq, Tk] mask for the
    folded queries. Built once per forward pass and shared by every layer."""
    bsz, tq, tk = allowed.shape
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, float("-inf"))
    return mask[:, None].expand(bsz, group, tq, tk).reshape(bsz, 1, group * tq, tk)


class MaskCache:
    """Per forward pass: the grouped additive form of each boolean mask, made on first use
    (when the layers' group size and dtype are known) and reused by every later layer."""

    def __init__(self):
        self._built: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def get(self, key: int, allowed: torch.Tensor | None, group: int, dtype: torch.dtype
            ) -> torch.Tensor | None:
        if allowed is None:
            return None
        cache_key = (key, group, dtype)
        if cache_key not in self._built:
            self._built[cache_key] = grouped_mask(allowed, group, dtype)
        return self._built[cache_key]


def causal_mask(tq: int, tk: int, device: torch.device, sliding_window: int | None = None,
                key_start: int = 0, sinks: int = 0) -> torch.Tensor:
    """[tq, tk - key_start] bool: query i (the last tq of tk positions) sees keys j <= its own
    position, and only the last `sliding_window` of them when set (and the first `sinks`
    positions); the keys are positions key_start..tk-1 (a window layer reads only the blocks
    its window reaches)."""
    q_pos = torch.arange(tk - tq, tk, device=device)[:, None]
    k_pos = torch.arange(key_start, tk, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= (k_pos > q_pos - sliding_window) | (k_pos < sinks)
    return allowed
