"""SparseGPT (Frantar & Alistarh, 2023, "SparseGPT: Massive Language Models Can Be Accurately
Pruned in One-Shot"): prune a weight column by column and spread each column's error over the
columns not yet visited, weighted by the inverse Hessian of the layer's reconstruction error
(H = 2 X^T X, GPTQ's machinery: `quantize/gptq.py`), so the kept weights make up for the pruned
ones.

As in the paper's reference code: columns in blocks of 128, each block's mask chosen when the
block comes up by the OBS saliency w^2 / [H^-1]_jj^2 of its columns as already updated (N:M:
every M columns, from those M); with `bits`, the kept weights of each column are rounded to a
per-group grid (chosen when the group's first column comes up) in the same pass, the error of
both pruning and rounding fed forward. Departure: an unstructured mask is chosen per output row
(each row loses the same share of every block), not over the whole block at once, so every row
keeps exactly its share, as Wanda's and magnitude masks do."""
from __future__ import annotations

import torch

from kvslim.formats.gptq import QuantizedWeight
from kvslim.surgery.prune.masks import SparsityTarget, pruned_mask
from kvslim.surgery.quantize.gptq import inverse_factor
from kvslim.surgery.quantize.rtn import grid, quantize


def sparsegpt_prune(weight: torch.Tensor, hessian: torch.Tensor, target: SparsityTarget,
                    bits: int | None = None, group_size: int = 128, sym: bool = True,
                    block_size: int = 128, percdamp: float = 0.01
                    ) -> tuple[torch.Tensor, QuantizedWeight | None]:
    """weight [out, in], hessian [in, in] -> the pruned weight (float32; dequantized when
    `bits`) and, with `bits`, its codes and grids in the GPTQ layout."""
    w, h = weight.detach().float().clone(), hessian.float().clone()
    n = w.shape[1]
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    hinv = inverse_factor(h, percdamp)
    g = n if group_size == -1 else group_size
    if bits is not None:             # whole groups per block (and whole N:M groups: m | g)
        block_size = g * max(1, block_size // g)
    codes = torch.zeros_like(w, dtype=torch.int64) if bits is not None else None
    scales, zeros = [], []
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        err = _prune_block(w, hinv, i1, i2, target, bits, g, sym, codes, scales, zeros)
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    if bits is None:
        return w, None
    quantized = QuantizedWeight(codes, torch.stack(zeros).long(), torch.stack(scales),
                                (torch.arange(n) // g).to(torch.int32))
    return w, quantized


def _prune_block(w, hinv, i1, i2, target: SparsityTarget, bits, g, sym, codes, scales,
                 zeros) -> torch.Tensor:
    """Columns [i1, i2) of w pruned (and rounded) in place, with error feedback inside the
    block; returns the scaled errors the columns after it receive."""
    block, hb = w[:, i1:i2], hinv[i1:i2, i1:i2]           # views: updated in place
    d = hb.diagonal()
    err = torch.zeros_like(block)
    mask = torch.zeros_like(block, dtype=torch.bool)
    k = 0 if target.structured else target.pruned_per_row(i1, i2)
    if k:                            # per row, this block's share of its pruned weights
        mask.scatter_(1, (block ** 2 / d ** 2).topk(k, dim=1, largest=False).indices, True)
    for i in range(i2 - i1):
        if target.structured and i % target.m == 0:
            cols = slice(i, i + target.m)
            mask[:, cols] = pruned_mask(block[:, cols] ** 2 / d[cols] ** 2, target)
        col = block[:, i]
        kept = torch.where(mask[:, i], 0.0, col)
        if bits is not None:
            if (i1 + i) % g == 0:
                scale, zero = grid(block[:, i:i + g], bits, sym)
                scales.append(scale)
                zeros.append(zero)
            code = torch.where(mask[:, i], zeros[-1], quantize(kept, scales[-1], zeros[-1], bits))
            codes[:, i1 + i] = code.long()
            kept = (code - zeros[-1]) * scales[-1]               # pruned: exactly zero
        e = (col - kept) / d[i]
        block[:, i:] -= e[:, None] * hb[i, i:][None, :]
        block[:, i] = kept
        err[:, i] = e
    return err
