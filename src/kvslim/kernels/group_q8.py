"""x @ w^T over group-quantized weights with x quantized to int8 per block of 32 inputs, as
llama.cpp runs its Q4/Q8 files: `torch.ops.kvslim.group_mm_q8` (csrc/group_q8.cpp says the
arithmetic and the layout), integer dot products (AVX-512 VNNI, AVX2 or scalar C++, the same
bits), batch-invariant by construction
(each row quantized on its own, integer sums exact, the float steps in one fixed order).

The activations' rounding is llama.cpp's (max |x| / 127 per block of 32), not float32's: the
engine runs this kernel when asked (`linear_activations="int8"`, kernels/activations.py), beside
kernels/tiled_gemm.py's float one, whose outputs are the dequantized weight's to float32
rounding (measured: `kvslim bench kernels`'s `.kvslim_q8` rows,
benchmarks/decode_gemm_stream.py, benchmarks/model_ppl.py --linear-activations).
`reference_group_linear_q8` is the same arithmetic in plain torch.

W8A8 layers run the same kernel with x quantized per row (`w8a8_mm`): their checkpoint's
arithmetic (quantization/w8a8.py), bit for bit the one torch._int_mm runs, and faster
(`kvslim bench kernels`'s `w8a8.kvslim_q8` rows)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvslim.kernels import extension
from kvslim.kernels.tiled_gemm import TILE

QBLOCK = 32


@dataclass
class Q8GroupWeight:
    qweight: torch.Tensor            # uint8 [tiles, in * 16 * bits / 8], the VNNI layout
    scales: torch.Tensor             # [tiles, groups, 16], float16 where exact, else float32
    # The same for 4-bit offsets; None for 4-bit weights whose offsets are -8 * scale
    # (llama.cpp's Q4_0, GPTQ's symmetric int4): the kernel takes 8 * sum(xq) off instead.
    mins: torch.Tensor | None
    colsum: torch.Tensor | None      # int32 [tiles, in / sub, 16], 8-bit: each block's sum of q
    bits: int
    out_features: int
    in_features: int
    per_row: bool = False            # W8A8: x's scale per row, the weight's per output

    @property
    def groups(self) -> int:
        return self.scales.shape[1]


def w8a8_usable(in_features: int) -> bool:
    """The per-row path's shapes: whole runs of 32 inputs."""
    return in_features % QBLOCK == 0


def usable(in_features: int, groups: int) -> bool:
    """The kernel's shapes: whole blocks of 32 inputs, groups of a multiple of 16."""
    return (in_features % QBLOCK == 0 and in_features % groups == 0
            and (in_features // groups) % 16 == 0)


def _tiles(t: torch.Tensor, tiles: int) -> torch.Tensor:
    """[out, ...] -> [tiles, 16, ...], the outputs padded with zeros to whole tiles."""
    padded = t.new_zeros(tiles * TILE, *t.shape[1:])
    padded[:t.shape[0]] = t
    return padded.view(tiles, TILE, *t.shape[1:])


def pack_q8_weight(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                   bits: int, per_row: bool = False) -> Q8GroupWeight:
    """q [out, in] (uint8 0..15 for 4-bit, int8 for 8-bit), scales (mins) [out, in / group]."""
    out, k = q.shape
    groups = scales.shape[1]
    if not usable(k, groups):
        raise ValueError(f"{k} inputs in {groups} groups: the int8-activation kernel needs "
                         f"blocks of 32 inputs and groups of a multiple of 16")
    if bits == 4 and mins is not None and offsets_of_eight(scales, mins, k // groups):
        mins = None
    tiles = -(-out // TILE)
    qt = _tiles(q, tiles)                                            # [tiles, 16, in]
    if bits == 4:
        chunks = qt.to(torch.uint8).view(tiles, TILE, k // 8, 2, 4)  # k = 8c + 4h + t
        packed = chunks[:, :, :, 0] | (chunks[:, :, :, 1] << 4)      # [tiles, 16, c, 4]
        packed = packed.permute(0, 2, 1, 3)                          # [tiles, c, 16 (j), 4 (t)]
        colsum = None
    else:
        q8 = qt.to(torch.int8)
        packed = q8.view(tiles, TILE, k // 4, 4).permute(0, 2, 1, 3).view(torch.uint8)
        sub = k if per_row else min(k // groups, QBLOCK)
        colsum = q8.to(torch.int32).view(tiles, TILE, k // sub, sub).sum(-1)
        colsum = colsum.transpose(1, 2).to(torch.int32).contiguous()  # [tiles, blocks, 16]
    dtype = torch.float32 if per_row else _scale_dtype(scales, mins)
    scales_t = _tiles(scales.to(dtype), tiles).transpose(1, 2).contiguous()
    mins_t = None if mins is None else _tiles(mins.to(dtype), tiles).transpose(1, 2).contiguous()
    return Q8GroupWeight(packed.reshape(tiles, -1).contiguous(), scales_t, mins_t, colsum, bits,
                         out, k, per_row)


def offsets_of_eight(scales: torch.Tensor, mins: torch.Tensor, group: int) -> bool:
    """Whether every 4-bit offset is -8 * its scale, w = (q - 8) * s, in groups of whole
    32-input blocks: the kernel then streams no offsets (a tenth fewer bytes for Q4_0)."""
    return group % QBLOCK == 0 and torch.equal(mins.float(), scales.float() * -8)


def _scale_dtype(scales: torch.Tensor, mins: torch.Tensor | None) -> torch.dtype:
    """float16 where every scale and offset is one exactly (GGUF's are: the kernel reads a
    sixth fewer bytes per 4-bit weight and converts them exactly), else float32."""
    for t in (scales, mins):
        f = None if t is None else t.float()
        if f is not None and not torch.equal(f.half().float(), f):
            return torch.float32
    return torch.float16


def pack_w8a8_weight(q: torch.Tensor, scales: torch.Tensor) -> Q8GroupWeight:
    """A W8A8 layer's int8 codes [out, in] and per-output scales [out] for `w8a8_mm`."""
    return pack_q8_weight(q, scales.float().reshape(-1, 1), None, 8, per_row=True)


def w8a8_mm(rows: torch.Tensor, weight: Q8GroupWeight,
            amax: torch.Tensor | None = None) -> torch.Tensor:
    """float32 rows [M, in] @ w^T with x quantized per row (quantize_per_token's codes and
    scales, `amax` as there): the same bits as torch._int_mm's product rescaled by
    quantization/kernels.py's w8a8_linear."""
    return torch.ops.kvslim.row_mm_q8(rows.float(), weight.qweight, weight.scales, weight.colsum,
                                      amax, weight.out_features)


def q8_linear(x: torch.Tensor, weight: Q8GroupWeight,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, weight.in_features).float()
    y = torch.ops.kvslim.group_mm_q8(rows, weight.qweight, weight.scales, weight.mins,
                                     weight.colsum, weight.bits, weight.out_features)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.out_features)


def reference_quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = x.float().view(x.shape[0], -1, QBLOCK)
    dx = blocks.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 127 / blocks.abs().amax(-1), torch.zeros_like(dx))
    return torch.round(blocks * inv[..., None]).to(torch.int8).view_as(x), dx


def reference_group_linear_q8(x, q, scales, mins) -> torch.Tensor:
    """The kernel's arithmetic in float64 on its own quantized activations."""
    xq, dx = reference_quantize_blocks(x)
    xd = (xq.double().view(x.shape[0], -1, QBLOCK) * dx.double()[..., None]).view(x.shape)
    groups = scales.shape[1]
    w = (q.double().view(q.shape[0], groups, -1) * scales.double()[..., None]).view(q.shape)
    y = xd @ w.T
    if mins is not None:
        y = y + xd.view(x.shape[0], groups, -1).sum(-1) @ mins.double().T
    return y


FAKES = {"quantize_blocks": lambda x: (x.new_empty(x.shape, dtype=torch.int8),
                                       x.new_empty(x.shape[0], x.shape[1] // QBLOCK)),
         "group_mm_q8": lambda x, qweight, scales, mins, colsum, bits, n:
             x.new_empty(x.shape[0], n),
         "quantize_rows": lambda x, amax: (x.new_empty(x.shape, dtype=torch.int8),
                                           x.new_empty(x.shape[0], 1)),
         "row_mm_q8": lambda x, qweight, scales, colsum, amax, n: x.new_empty(x.shape[0], n)}


def available() -> bool:
    """Built: every build has a path (AVX-512 VNNI, AVX2 or scalar C++), all the same bits."""
    return extension.ensure(FAKES)


def isa() -> str | None:
    """The integer dot products this build runs: avx512_vnni, avx2, scalar; None unbuilt."""
    return str(torch.ops.kvslim.q8_isa()) if available() else None
