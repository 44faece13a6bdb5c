"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): quantize a weight one input column at a time and spread each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian of
the layer's reconstruction error, H = 2 X^T X over calibration inputs X.

As in the paper's reference code: H is dampened by 1% of its mean diagonal, its inverse is
taken through Cholesky and kept as the upper Cholesky factor (whose rows are the updates), the
error of a block of 128 columns is applied to the rest of the matrix once per block (lazy batch
updates), and act-order quantizes columns in order of decreasing diag(H), recording each input
channel's group in g_idx. Group grids are chosen when their first column comes up, from the
columns as already updated by the error of the ones before."""
from __future__ import annotations

import torch

from kvslim.formats.gptq import QuantizedWeight
from kvslim.surgery.quantize.rtn import grid, quantize


class Hessian:
    """H = 2/N sum x x^T over N input rows, accumulated batch by batch."""

    def __init__(self, in_features: int):
        self.matrix = torch.zeros(in_features, in_features)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        total = self.rows + x.shape[0]
        self.matrix *= self.rows / total
        x = x * (2 / total) ** 0.5
        self.matrix += x.t() @ x
        self.rows = total


def inverse_factor(hessian: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of the dampened H's inverse."""
    h = hessian.clone()
    h.diagonal().add_(percdamp * h.diagonal().mean())
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
                  sym: bool = True, act_order: bool = False, block_size: int = 128,
                  percdamp: float = 0.01) -> QuantizedWeight:
    """weight [out, in], hessian [in, in] -> codes and per-group grids in the GPTQ layout."""
    w, h = weight.detach().float().clone(), hessian.float().clone()
    n = w.shape[1]
    g = n if group_size == -1 else group_size
    dead = h.diagonal() == 0                 # inputs never active: any code will do
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = (torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(n))
    w, h = w[:, perm], h[perm][:, perm]
    hinv = inverse_factor(h, percdamp)
    block = g * max(1, block_size // g)      # a whole number of groups per block
    q = torch.empty_like(w, dtype=torch.int64)
    scales, zeros = [], []
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        q[:, i1:i2], err = _quantize_block(w[:, i1:i2], hinv[i1:i2, i1:i2], g, bits, sym,
                                           scales, zeros)
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    inverse = torch.argsort(perm)
    g_idx = (torch.arange(n) // g)[inverse].to(torch.int32)
    return QuantizedWeight(q[:, inverse], torch.stack(zeros).long(), torch.stack(scales), g_idx)


def _quantize_block(w: torch.Tensor, hinv: torch.Tensor, g: int, bits: int, sym: bool,
                    scales: list, zeros: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the columns of one block in order with error feedback inside the block. Appends
    the grids of the groups starting here to scales and zeros; returns the codes and the
    scaled errors that the columns after the block receive."""
    w = w.clone()
    q = torch.empty_like(w, dtype=torch.int64)
    err = torch.zeros_like(w)
    for i in range(w.shape[1]):
        if i % g == 0:
            scale, zero = grid(w[:, i:i + g], bits, sym)
            scales.append(scale)
            zeros.append(zero)
        col = w[:, i]
        code = quantize(col, scale, zero, bits)
        q[:, i] = code.long()
        e = (col - (code - zero) * scale) / hinv[i, i]
        w[:, i:] -= e.unsqueeze(1) * hinv[i, i:].unsqueeze(0)
        err[:, i] = e
    return q, err
