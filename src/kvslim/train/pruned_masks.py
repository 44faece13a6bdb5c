"""A pruned model's zeros kept through uptraining. `kvslim prune` zeroes weights of every
decoder linear; an optimizer step would refill them and the model would be dense again. The
masks are read from the weights when training starts (in a model config.json marks as pruned,
a decoder weight that is exactly zero was pruned). Each step's gradients are masked before the
optimizer sees them, so AdamW's moments of a pruned weight stay zero and so does its update
(weight decay of a zero is zero); the weights are masked again after the step all the same."""
from __future__ import annotations

import torch

from kvslim.models.causal_lm import CausalLM


class PrunedMasks:
    def __init__(self, masks: list[tuple[torch.nn.Parameter, torch.Tensor]]):
        self.masks = masks                     # (weight, True where the weight is kept)

    @classmethod
    def of(cls, model: CausalLM) -> "PrunedMasks | None":
        """The masks of a pruned model's decoder matrices; None for a model never pruned."""
        if model.config.pruning is None:
            return None
        return cls([(p, p.detach() != 0) for p in model.model.layers.parameters()
                    if p.dim() == 2])

    @torch.no_grad()
    def before_clip(self) -> None:
        """Pruned weights' gradients zeroed."""
        for weight, kept in self.masks:
            if weight.grad is not None:
                weight.grad.mul_(kept)

    @torch.no_grad()
    def after_step(self) -> None:
        """Pruned weights zeroed again."""
        for weight, kept in self.masks:
            weight.mul_(kept)

    def sparsity(self) -> float:
        """The fraction of the masked matrices' weights that are pruned."""
        total = sum(kept.numel() for _, kept in self.masks)
        return 1 - sum(int(kept.sum()) for _, kept in self.masks) / max(1, total)
