"""x @ w^T with float32 activations over weights in tiles of 16 output columns
(csrc/tiled_gemm.cpp says the arithmetic and the layout), batch-invariant by construction:

    torch.ops.kvslim.group_mm   4-bit: w = q * s + m   (q 0..15; GGUF Q4_0, Q4_1, Q4_K; GPTQ)
                                8-bit: w = q * s       (q -128..127; GGUF Q8_0, Q5_0, Q6_K)
    torch.ops.kvslim.tiled_mm   float32 w

`pack_group_weight` turns [out, in] integers and their [out, in / group] scales (and mins) into
the kernel's tiles once, at load, `pack_float_weight` a float weight; `group_linear` and
`float_linear` run them. `reference_group_linear` is the group kernel's arithmetic in plain
torch (each group's integer dot product, then its scale and offset), which the tests hold the
kernel to."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvslim.kernels import extension

TILE = 16                      # output columns per tile (csrc/tiled_gemm.cpp's NT)


@dataclass
class GroupWeight:
    """The kernel's form of one weight: tiles of 16 output columns."""
    qweight: torch.Tensor            # uint8 [tiles, in * 16 * bits / 8]
    scales: torch.Tensor             # float32 [tiles, groups, 16]
    mins: torch.Tensor | None        # float32 [tiles, groups, 16], 4-bit only
    bits: int
    out_features: int
    in_features: int

    @property
    def group(self) -> int:
        return self.in_features // self.scales.shape[1]

    def nbytes(self) -> int:
        extra = 0 if self.mins is None else self.mins.nbytes
        return self.qweight.nbytes + self.scales.nbytes + extra


def _tiles(t: torch.Tensor, tiles: int) -> torch.Tensor:
    """[out, cols] -> [tiles, cols, 16], the output columns padded with zeros to whole tiles."""
    out = t.shape[0]
    padded = t.new_zeros(tiles * TILE, t.shape[1])
    padded[:out] = t
    return padded.view(tiles, TILE, -1).transpose(1, 2).contiguous()


def pack_group_weight(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      bits: int) -> GroupWeight:
    """q: [out, in] integers (uint8 0..15 for 4-bit, int8 for 8-bit); scales (and for 4-bit
    mins): [out, in / group]."""
    if bits not in (4, 8):
        raise ValueError(f"group_mm packs 4- or 8-bit weights, not {bits}-bit")
    if (bits == 4) != (mins is not None):
        raise ValueError("4-bit weights take mins, 8-bit ones none")
    out, k = q.shape
    groups = scales.shape[1]
    if k % groups or (bits == 4 and (k // groups) % 2):
        raise ValueError(f"{k} inputs do not split into {groups} groups"
                         + (" of an even size" if bits == 4 else ""))
    tiles = -(-out // TILE)
    if bits == 4:
        nibbles = q.to(torch.uint8).view(out, k // 2, 2)
        packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    else:
        packed = q.to(torch.int8).view(torch.uint8)
    qweight = _tiles(packed, tiles).view(tiles, -1)
    return GroupWeight(qweight, _tiles(scales.float(), tiles),
                       None if mins is None else _tiles(mins.float(), tiles), bits, out, k)


def group_linear(x: torch.Tensor, weight: GroupWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] (+ bias) in x's dtype, computed in float32."""
    rows = x.reshape(-1, weight.in_features)
    y = torch.ops.kvslim.group_mm(rows.float(), weight.qweight, weight.scales, weight.mins,
                                  weight.bits, weight.out_features)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)


@dataclass
class FloatWeight:
    """A float32 weight in the kernel's tiles: [tiles, in * 16]."""
    tiles: torch.Tensor
    out_features: int
    in_features: int


def pack_float_weight(weight: torch.Tensor) -> FloatWeight:
    """[out, in] -> the tiles of `tiled_mm` (float32)."""
    out, k = weight.shape
    tiles = -(-out // TILE)
    return FloatWeight(_tiles(weight.detach().float(), tiles).view(tiles, -1), out, k)


def float_linear(x: torch.Tensor, weight: FloatWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] (+ bias) in x's dtype, computed in float32."""
    rows = x.reshape(-1, weight.in_features)
    y = torch.ops.kvslim.tiled_mm(rows.float(), weight.tiles, weight.out_features)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)


def reference_group_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                           mins: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in plain torch, in float64: the bound the tests hold it to."""
    rows = x.reshape(-1, q.shape[1]).double()
    groups = scales.shape[1]
    xg = rows.view(rows.shape[0], groups, -1)                        # [M, G, g]
    qg = q.double().view(q.shape[0], groups, -1)                     # [N, G, g]
    dots = torch.einsum("mgk,ngk->mng", xg, qg)                      # [M, N, G]
    y = (dots * scales.double()).sum(-1)
    if mins is not None:
        y = y + xg.sum(-1) @ mins.double().T
    return y.view(*x.shape[:-1], q.shape[0])


FAKES = {"group_mm": lambda x, qweight, scales, mins, bits, n: x.new_empty(x.shape[0], n),
         "tiled_mm": lambda x, weight, n: x.new_empty(x.shape[0], n)}


def available() -> bool:
    """Whether the kernels can run (the extension builds or is built); their fakes registered."""
    return extension.ensure(FAKES)
