"""Round-to-nearest quantization, per group of input channels, and the quantizer GPTQ shares.

A group's grid: asymmetric, [min(w, 0), max(w, 0)] in 2**bits - 1 steps with an integer zero
point; symmetric, [-m, m] with m = max |w| and the zero point in the middle (2**(bits - 1)), as
in the GPTQ reference code. Scales are rounded to float16 before any code is chosen, because
float16 is what the checkpoint stores: the codes are the best ones for the stored scale."""
from __future__ import annotations

import torch

from kvslim.formats.gptq import QuantizedWeight

FP16_TINY = 6.2e-5          # smallest normal float16: a scale below it would not survive storing


def grid(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point [rows] for the values w [rows, n] (one group of each row)."""
    maxq = 2 ** bits - 1
    w = w.float()
    lo, hi = w.min(dim=1).values.clamp(max=0), w.max(dim=1).values.clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    flat = (lo == 0) & (hi == 0)
    lo, hi = torch.where(flat, -1.0, lo), torch.where(flat, 1.0, hi)
    scale = ((hi - lo) / maxq).clamp(min=FP16_TINY).half().float()
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.round(-lo / scale).clamp(0, maxq)
    return scale, zero


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in [0, 2**bits) for w [rows, ...] on the grid (scale, zero) [rows]."""
    shape = (-1,) + (1,) * (w.dim() - 1)
    q = torch.round(w.float() / scale.view(shape)) + zero.view(shape)
    return q.clamp(0, 2 ** bits - 1)


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool = True
                 ) -> QuantizedWeight:
    """weight [out, in] with groups of `group_size` consecutive input channels (-1: one)."""
    out, n = weight.shape
    g = n if group_size == -1 else group_size
    q = torch.empty(out, n, dtype=torch.int64)
    scales, zeros = [], []
    for start in range(0, n, g):
        block = weight[:, start:start + g]
        scale, zero = grid(block, bits, sym)
        q[:, start:start + g] = quantize(block, scale, zero, bits).long()
        scales.append(scale)
        zeros.append(zero)
    return QuantizedWeight(q, torch.stack(zeros).long(), torch.stack(scales),
                           (torch.arange(n) // g).to(torch.int32))
