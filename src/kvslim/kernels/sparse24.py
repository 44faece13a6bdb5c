"""x @ w^T over a 2:4-sparse float32 weight (at most two nonzeros in every four consecutive
inputs of a row, what `kvslim prune --pattern 2:4` leaves), reading only the kept values and
their 2-bit positions: `torch.ops.kvslim.sparse24_mm` (csrc/sparse24_gemm.cpp says the
arithmetic and the layout), batch-invariant by construction.

`pack_sparse24_weight` turns a dense [out, in] weight into the kernel's tiles once (refusing
one that is not 2:4), `sparse24_linear` runs it (the kernel, or where the extension is missing
the reference), `reference_sparse24_linear` is the kernel's arithmetic in plain torch: each
output one chain of float32 fused multiply-adds, group by group, the lower position first,
emulated exactly in float64 (the kernel's bits, which the tests hold it to).

Measured against the dense kernels by benchmarks/sparse_kernel.py (docs/pruning_kernel.json)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvslim.kernels import extension
from kvslim.kernels.tiled_gemm import TILE

GROUP = 4                      # inputs per group, of which at most KEPT are nonzero
KEPT = 2


@dataclass
class Sparse24Weight:
    """The kernel's form of one weight, in tiles of 16 output columns."""
    values: torch.Tensor             # float32 [tiles, in / 4 * 2 * 16]
    index: torch.Tensor              # int32 [tiles, in / 4 * 2]: the positions, 4 bits a column
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return self.values.nbytes + self.index.nbytes


def _positions(weight: torch.Tensor) -> torch.Tensor:
    """[out, groups, 2] int64: each group's nonzero positions, ascending (a group with fewer
    than two takes its lowest zero ones besides)."""
    zero = (weight == 0).to(torch.uint8)                            # [out, groups, 4]
    order = torch.sort(zero, dim=-1, stable=True).indices[..., :KEPT]
    return order.sort(dim=-1).values


def pack_sparse24_weight(weight: torch.Tensor) -> Sparse24Weight:
    """[out, in] float weight with at most two nonzeros in each group of four inputs ->
    the tiles of `sparse24_mm`."""
    if weight.dim() != 2:
        raise ValueError(f"a 2:4 weight is [out, in], not {tuple(weight.shape)}")
    out, k = weight.shape
    if k % GROUP:
        raise ValueError(f"{k} inputs are not whole groups of {GROUP}")
    w = weight.detach().float().view(out, k // GROUP, GROUP)
    counts = (w != 0).sum(-1)
    if (counts > KEPT).any():
        row, g = (counts > KEPT).nonzero()[0].tolist()
        raise ValueError(f"not a 2:4 weight: row {row} has {int(counts[row, g])} nonzeros "
                         f"in inputs {GROUP * g}..{GROUP * g + GROUP - 1}")
    pos = _positions(w)
    vals = w.gather(-1, pos)                                         # [out, groups, 2]
    tiles, groups = -(-out // TILE), k // GROUP
    v = vals.new_zeros(tiles * TILE, groups, KEPT)
    p = pos.new_zeros(tiles * TILE, groups, KEPT)
    p[:, :, 1] = 1                                                   # the padding's columns
    v[:out], p[:out] = vals, pos
    values = v.view(tiles, TILE, groups, KEPT).permute(0, 2, 3, 1).contiguous()
    nib = (p[..., 0] | (p[..., 1] << 2)).view(tiles, 2, 8, groups)   # [tiles, half, col, g]
    words = (nib << (4 * torch.arange(8).view(1, 1, 8, 1))).sum(2)   # [tiles, half, groups]
    index = words.permute(0, 2, 1).contiguous()
    index = torch.where(index >= 2**31, index - 2**32, index).to(torch.int32)
    return Sparse24Weight(values.view(tiles, -1), index.view(tiles, -1), out, k)


def unpack(weight: Sparse24Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept values and their positions, [out, groups, 2] each (float32, int64)."""
    tiles, groups, out = weight.values.shape[0], weight.in_features // GROUP, weight.out_features
    values = weight.values.view(tiles, groups, KEPT, TILE).permute(0, 3, 1, 2)
    words = weight.index.view(tiles, groups, 2).long() & 0xFFFFFFFF
    shifts = 4 * torch.arange(8)
    nib = (words[..., None] >> shifts) & 15                          # [tiles, g, half, col]
    nib = nib.permute(0, 2, 3, 1).reshape(tiles, TILE, groups)
    pos = torch.stack([nib & 3, nib >> 2], -1)
    return (values.reshape(tiles * TILE, groups, KEPT)[:out],
            pos.reshape(tiles * TILE, groups, KEPT)[:out])


def dense(weight: Sparse24Weight) -> torch.Tensor:
    """The [out, in] float32 weight the tiles hold."""
    values, pos = unpack(weight)
    w = values.new_zeros(weight.out_features, weight.in_features // GROUP, GROUP)
    return w.scatter(-1, pos, values).view(weight.out_features, weight.in_features)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once, as the hardware's fused multiply-add (finite inputs):
    the product is exact in float64, the sum's error exact by TwoSum, the sum rounded to odd
    in float64 and then to float32, which rounds correctly (53 >= 24 + 2 bits)."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(s.dtype)
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s).float()


def reference_sparse24_linear(x: torch.Tensor, weight: Sparse24Weight) -> torch.Tensor:
    """The kernel's arithmetic in plain torch, bit for bit: x [..., in] float32 -> [..., out]."""
    rows = x.reshape(-1, weight.in_features).float()
    values, pos = unpack(weight)
    acc = rows.new_zeros(rows.shape[0], weight.out_features)
    for g in range(weight.in_features // GROUP):
        for j in range(KEPT):
            picked = rows[:, GROUP * g + pos[:, g, j]]                # [M, out]
            acc = fma32(values[:, g, j], picked, acc)
    return acc.view(*x.shape[:-1], weight.out_features)


def sparse24_linear(x: torch.Tensor, weight: Sparse24Weight,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] (+ bias) in x's dtype, computed in float32."""
    rows = x.reshape(-1, weight.in_features).float()
    if available():
        y = torch.ops.kvslim.sparse24_mm(rows, weight.values, weight.index, weight.out_features)
    else:
        y = reference_sparse24_linear(rows, weight)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)


FAKES = {"sparse24_mm": lambda x, values, index, n: x.new_empty(x.shape[0], n)}


def available() -> bool:
    """Whether the kernel can run (the extension builds or is built); its fake registered."""
    return extension.ensure(FAKES)
