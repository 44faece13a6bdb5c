"""The GPTQ checkpoint layout (docs/quantization-formats.md): one quantized matrix as the tensors a
checkpoint stores for it, and back.

A `QuantizedWeight` is the unpacked form quantization produces: integer codes q [out, in], and
per group a zero point and a scale for every output row. `pack_gptq` turns it into the stored
tensors (`qweight`, `qzeros`, `scales` in float16, `g_idx`), `unpack_gptq` reads them back. The
bit packing itself is the layers' (`kvslim.quantization.gptq`), which run from the packed
form."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvslim.quantization.base import QuantSpec
from kvslim.quantization.gptq import pack_int32, unpack_int32


@dataclass
class QuantizedWeight:
    q: torch.Tensor          # [out, in] integers in [0, 2**bits)
    zeros: torch.Tensor      # [groups, out] integers in [0, 2**bits)
    scales: torch.Tensor     # [groups, out] float
    g_idx: torch.Tensor      # [in] the group of each input channel

    def dequantize(self) -> torch.Tensor:
        """w[o, i] = (q[o, i] - zeros[g_idx[i], o]) * scales[g_idx[i], o], [out, in] in the
        scales' dtype."""
        g = self.g_idx.long()
        return (self.q - self.zeros[g].t()).to(self.scales.dtype) * self.scales[g].t()

    def rows(self, rows: slice) -> "QuantizedWeight":
        """The output rows `rows` (one checkpoint shard of a fused layer)."""
        return QuantizedWeight(self.q[rows], self.zeros[:, rows], self.scales[:, rows],
                               self.g_idx)


def pack_gptq(weight: QuantizedWeight, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one matrix: qweight, qzeros, scales (float16), g_idx."""
    return {
        "qweight": pack_int32(weight.q.t(), spec.bits, dim=0),
        "qzeros": pack_int32(spec.zeros_to_stored(weight.zeros.to(torch.int64)), spec.bits,
                             dim=1),
        "scales": weight.scales.to(torch.float16).contiguous(),
        "g_idx": weight.g_idx.to(torch.int32).clone(),      # fused shards share one
    }


def unpack_gptq(tensors: dict[str, torch.Tensor], spec: QuantSpec) -> QuantizedWeight:
    """The inverse of `pack_gptq`. Checkpoints without g_idx get groups in input order."""
    q = unpack_int32(tensors["qweight"], spec.bits, dim=0).t()
    zeros = spec.zeros_from_stored(unpack_int32(tensors["qzeros"], spec.bits, dim=1))
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        g_idx = group_index(q.shape[1], spec.group_size)
    return QuantizedWeight(q, zeros, tensors["scales"], g_idx.to(torch.int32))


def group_index(in_features: int, group_size: int) -> torch.Tensor:
    """g_idx without act-order: input channel i is in group i // group_size (-1: one group)."""
    size = group_size if group_size > 0 else in_features
    return (torch.arange(in_features) // size).to(torch.int32)
