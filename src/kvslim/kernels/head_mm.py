"""`torch.ops.kvslim.head_mm(x, w)`: x [N, H, K] @ w [H, K, O] -> [N, H, O], a matrix product
per attention head whose every output is one chain of multiply-adds in input order
(csrc/head_mm.cpp): a row's numbers do not depend on the number of rows. DeepSeek's absorbed
latent attention runs its per-head W_UK and W_UV through it on the CPU in float32
(layers/latent_attention.py); elsewhere, or without the extension, `torch.bmm`."""
from __future__ import annotations

import torch

from kvslim.kernels import extension

FAKES = {"head_mm": lambda x, w: x.new_empty(x.shape[0], x.shape[1], w.shape[2])}

# Resolved once, eagerly (`LatentAttention.absorb`).
available = extension.ResolvedOnce(FAKES)


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and available()


def head_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, H, K] (any strides), w [H, K, O] -> [N, H, O]: the kernel where `usable`, else
    torch.bmm (batched GEMM: its blocking may change with N)."""
    if usable(x):
        return torch.ops.kvslim.head_mm(x, w)
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)
