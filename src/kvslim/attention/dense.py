"""Causal attention over a [batch, time] block with optional key padding: training, perplexity and
reference forward passes. No KV cache."""
from __future__ import annotations

import torch

from kvslim.attention.grouped import MaskCache, causal_mask, grouped_sdpa


class DenseAttention:
    def __init__(self, seq_len: int, device: torch.device, padding_mask: torch.Tensor | None = None,
                 sliding_window: int | None = None):
        """padding_mask [B, T] bool, True for real tokens (left or right padding both work)."""
        self.allowed = None
        self.masks = MaskCache()
        if padding_mask is not None or sliding_window is not None:
            allowed = causal_mask(seq_len, seq_len, device, sliding_window).unsqueeze(0)
            if padding_mask is not None:
                allowed = allowed & padding_mask[:, None, :].bool()
                # A padded query row would see no key at all and give NaN; let it see itself.
                allowed = allowed | torch.eye(seq_len, dtype=torch.bool, device=device)
            self.allowed = allowed

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        group = q.shape[-2] // k.shape[-2]
        return grouped_sdpa(q, k, v, self.masks.get(0, self.allowed, group, q.dtype), scale)
