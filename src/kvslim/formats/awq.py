"""The AWQ GEMM checkpoint layout (AutoAWQ's `WQLinear_GEMM`, quant_method "awq", version
"gemm"; docs/quantization-formats.md), read into the GPTQ layout `GPTQLinear` holds.

Per linear layer of `in` inputs and `out` outputs, 4 bits, groups = in / group_size:

    qweight int32 [in, out / 8]        codes packed along the OUTPUT dim, in AWQ's nibble order
    qzeros  int32 [groups, out / 8]    zero points, packed the same way, stored as they are
    scales  fp16  [groups, out]
    w[o, i] = (q[i, o] - zero[i // group_size, o]) * scale[i // group_size, o]

Word c of a row holds outputs 8c … 8c + 7, but not in order: its nibble k (bits 4k … 4k + 3)
holds output 8c + AWQ_ORDER[k]. Checked against AutoAWQ's awq/modules/linear/gemm.py
(`from_linear`'s packing loop) and awq/utils/packing_utils.py (`AWQ_REVERSE_ORDER`, used to
unpack), which vLLM's awq_triton.py uses as well."""
from __future__ import annotations

import torch

from kvslim.formats.gptq import group_index
from kvslim.quantization.base import QuantSpec
from kvslim.quantization.gptq import pack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)       # nibble k of a word holds output 8c + AWQ_ORDER[k]
# Output 8c + j sits in nibble AWQ_REVERSE_ORDER[j]: the inverse permutation, which is
# AutoAWQ's own constant (0, 4, 1, 5, 2, 6, 3, 7).
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(j) for j in range(8))
LEAVES = ("qweight", "qzeros", "scales")


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [rows, cols] -> int32 [rows, cols / 8] in AWQ's order."""
    rows, cols = values.shape
    nibbles = values.reshape(rows, cols // 8, 8)[..., list(AWQ_ORDER)]
    return pack_int32(nibbles.reshape(rows, cols), 4, dim=1)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_awq`: uint8 values [rows, cols]. Works on the int32 words one
    nibble at a time, each into its own contiguous plane, and interleaves the planes once: no
    int64 copy of the layer (a 4096 x 11008 layer unpacks in about 0.15 s on one core instead
    of 2)."""
    rows, words_per_row = words.shape
    planes = torch.empty(8, rows, words_per_row, dtype=torch.uint8)
    for k, column in enumerate(AWQ_ORDER):
        planes[column] = (words >> (4 * k)) & 0xF
    return planes.permute(1, 2, 0).reshape(rows, words_per_row * 8)


def pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit values [rows, cols] -> int32 [rows / 8, cols]: GPTQ's qweight, 8 consecutive
    rows per word, the first in the lowest bits (`pack_int32(values, 4, dim=0)`, in int32)."""
    rows, cols = values.shape
    grouped = values.reshape(rows // 8, 8, cols)
    words = torch.zeros(rows // 8, cols, dtype=torch.int32)
    for j in range(8):                                  # j = 7 wraps into the sign bit, as stored
        words |= grouped[:, j].to(torch.int32) << (4 * j)
    return words


def stored_shapes(spec: QuantSpec, out_features: int, in_features: int
                  ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each stored tensor of one layer: its shape and kind of dtype."""
    groups = spec.num_groups(in_features)
    return {"qweight": ((in_features, out_features // 8), "int32"),
            "qzeros": ((groups, out_features // 8), "int32"),
            "scales": ((groups, out_features), "float")}


def leaves(spec: QuantSpec) -> tuple[str, ...]:
    return LEAVES


def to_gptq(prefix: str, tensors: dict[str, torch.Tensor], spec: QuantSpec
            ) -> dict[str, torch.Tensor]:
    """One layer's AWQ tensors (shapes checked) as GPTQ-layout tensors with the same codes,
    zero points and scales: qweight repacked along the input dim, qzeros in plain order (kept
    as stored: the layer reads zeros as is for every format but GPTQ v1)."""
    q = unpack_awq(tensors["qweight"])                                  # [in, out]
    zeros = unpack_awq(tensors["qzeros"])                               # [groups, out]
    return {"qweight": pack_int4_rows(q),
            "qzeros": pack_int32(zeros, 4, dim=1),
            "scales": tensors["scales"],
            "g_idx": group_index(q.shape[0], spec.group_size)}
