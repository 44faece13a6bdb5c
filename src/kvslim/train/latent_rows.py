"""Uptraining a latent attention whose norm is exact (`kvslim convert --to-mla --latent-norm
exact`, surgery/mla/factorize.py): its latent rows of kv_a_proj_with_mqa are the converter's
rows times alpha (~1e-9 / their RMS), so that DeepSeek's RMSNorm of the latent is linear, and
kv_a_layernorm's weight sqrt(eps) / alpha undoes the scale.

Trained as they are, those rows would not survive: their gradients are 1/alpha times the
unscaled rows', so the global gradient-norm clip would shrink every other gradient to nothing,
and AdamW's steps (about lr, whatever the gradient's scale) are many times the rows themselves.
Here they train as the unscaled rows W = W' / alpha would: each step's gradient is multiplied by
alpha before the clip (dL/dW = alpha dL/dW'), and the optimizer's change to the rows by alpha
after it (W' = alpha W), the same optimizer run on W. A norm is taken to be exact when its weight
is above `EXACT_WEIGHT_MIN` (the converter's is ~1e6 x the latent's RMS; a trained DeepSeek
model's is of order 1)."""
from __future__ import annotations

import math

import torch

from kvslim.layers.latent_attention import LATENT_NORM_EPS, LatentAttention

EXACT_WEIGHT_MIN = 1e3


class ExactLatentRows:
    def __init__(self, rows: list[tuple[torch.nn.Parameter, int, float]]):
        self.rows = rows                       # (kv_a_proj_with_mqa's weight, rank, alpha)
        self._before: list[torch.Tensor] = []

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ExactLatentRows | None":
        """The exact latent norms' rows of `model`; None when it has none."""
        rows = []
        for module in model.modules():
            if isinstance(module, LatentAttention):
                weight = module.kv_a_layernorm.weight.detach().float().abs().mean().item()
                if weight > EXACT_WEIGHT_MIN:
                    rows.append((module.kv_a_proj_with_mqa.weight, module.kv_lora_rank,
                                 math.sqrt(LATENT_NORM_EPS) / weight))
        return cls(rows) if rows else None

    @torch.no_grad()
    def before_clip(self) -> None:
        """Gradients of the rows in their unscaled units; the rows kept for `after_step`."""
        self._before = []
        for weight, rank, alpha in self.rows:
            if weight.grad is not None:
                weight.grad[:rank].mul_(alpha)
            self._before.append(weight[:rank].clone())

    @torch.no_grad()
    def after_step(self) -> None:
        """The optimizer's change to the rows scaled by alpha."""
        for (weight, rank, alpha), before in zip(self.rows, self._before):
            rows = weight[:rank]
            rows.copy_(before + (rows - before) * alpha)
