"""Grouped-query attention without copying K/V per query head.

The G query heads that share one KV head are folded into the query-length axis:
q [B, Tq, H, D] -> [B, KVH, G*Tq, D]. One scaled-dot-product call then attends every row of a
group to the same K/V tensor [B, KVH, Tk, D] (a strided view of the cache or of the projection)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, Tq, H, D]; k, v [B, Tk, KVH, D]; allowed bool [B or 1, Tq, Tk] (True = may attend),
    None for plain causal with Tq == Tk. Returns [B, Tq, H, D]."""
    b, tq, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    qg = q.view(b, tq, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * tq, d)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    if allowed is None and g == 1:
        out = F.scaled_dot_product_attention(qg, kt, vt, is_causal=True, scale=scale)
    else:
        if allowed is None:
            allowed = causal_mask(tq, tq, q.device).unsqueeze(0)
        mask = allowed.unsqueeze(1).expand(allowed.shape[0], g, tq, allowed.shape[-1])
        mask = mask.reshape(allowed.shape[0], 1, g * tq, allowed.shape[-1])
        out = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask, scale=scale)
    return out.view(b, kvh, g, tq, d).permute(0, 3, 1, 2, 4).reshape(b, tq, h, d)


def causal_mask(tq: int, tk: int, device: torch.device, sliding_window: int | None = None,
                ) -> torch.Tensor:
    """[tq, tk] bool: query i (the last tq of tk positions) sees keys j <= its own position,
    and only the last `sliding_window` of them when set."""
    q_pos = torch.arange(tk - tq, tk, device=device)[:, None]
    k_pos = torch.arange(tk, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed
