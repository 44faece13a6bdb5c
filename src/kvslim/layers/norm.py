"""RMSNorm, as Llama-family models compute it, and Gemma's variant."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.kernels import decoder_layer


class RMSNorm(nn.Module):
    native = False      # set where its layer runs as one native call: the same kernel then

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and decoder_layer.rms_norm_usable(x):   # the native layer's kernel
            return decoder_layer.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:                  # one fused kernel, same result
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 and cast back before the weight, exactly like the reference.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def kernel_weight(self) -> torch.Tensor:
        """The weight the native kernel multiplies by (`native`'s path and the native layer)."""
        return self.weight.detach()


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from one (initialised to zeros) and the product
    is taken in float32 before the cast back, not after it as in Llama."""

    native = False      # as RMSNorm's, with the kernel multiplying by 1 + w
    _kernel_weight: torch.Tensor | None = None

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and decoder_layer.rms_norm_usable(x):
            return decoder_layer.rms_norm(x, self.kernel_weight(), self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)

    def kernel_weight(self) -> torch.Tensor:
        """1 + w, as the reference adds it, made once: a norm marked native is for inference
        only, its weight no longer changes."""
        if self._kernel_weight is None:
            self._kernel_weight = (1.0 + self.weight.detach().float()).contiguous()
        return self._kernel_weight


# Every norm layer a model holds (replicated whole on every tensor-parallel rank).
NORMS = (RMSNorm, GemmaRMSNorm)
