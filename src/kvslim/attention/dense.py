"""Causal attention over a [batch, time] block with optional key padding: training, perplexity and
reference forward passes. No KV cache.

Like the paged backend, the mask is built once per forward pass (`build_dense_mask`) and the
layers only read it."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvslim.attention.grouped import MaskCache, causal_mask, grouped_sdpa


def build_dense_mask(seq_len: int, device: torch.device, padding_mask: torch.Tensor | None = None,
                     sliding_window: int | None = None, sinks: int = 0) -> torch.Tensor | None:
    """[B or 1, T, T] bool (True = may attend), or None for plain causal attention.
    padding_mask [B, T] bool, True for real tokens (left or right padding both work). sinks:
    with a window, the first positions every query also sees (kv_cache/window.py)."""
    if padding_mask is None and sliding_window is None:
        return None
    allowed = causal_mask(seq_len, seq_len, device, sliding_window, sinks=sinks).unsqueeze(0)
    if padding_mask is not None:
        allowed = allowed & padding_mask[:, None, :].bool()
        # A padded query row would see no key at all and give NaN; let it see itself.
        allowed = allowed | torch.eye(seq_len, dtype=torch.bool, device=device)
    return allowed


class DenseAttention:
    def __init__(self, seq_len: int, device: torch.device, padding_mask: torch.Tensor | None = None,
                 sliding_window: int | None | Sequence[int | None] = None,
                 sinks: dict[int | None, int] | None = None):
        """padding_mask [B, T] bool, True for real tokens (left or right padding both work).
        sliding_window: one window for every layer, or one per layer (None: global), as in
        models that mix local and global layers; one mask is built per distinct window.
        sinks: a window's sink tokens, by window (kv_cache/window.py's spans)."""
        self.layer_windows = (list(sliding_window) if isinstance(sliding_window, (list, tuple))
                              else None)
        windows = set(self.layer_windows) if self.layer_windows is not None else {sliding_window}
        sinks = sinks or {}
        self.allowed = {w: build_dense_mask(seq_len, device, padding_mask, w, sinks.get(w, 0))
                        for w in windows}
        self.default = sliding_window if self.layer_windows is None else None
        self.masks = MaskCache()

    def caches_latent(self, layer_idx: int) -> bool:
        """No cache: MLA layers attend over their expanded heads (layers/latent_attention.py)."""
        return False

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        group = q.shape[-2] // k.shape[-2]
        window = self.default if self.layer_windows is None else self.layer_windows[layer_idx]
        mask = self.masks.get(window or 0, self.allowed[window], group, q.dtype)
        return grouped_sdpa(q, k, v, mask, scale)
