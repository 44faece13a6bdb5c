"""The compressed-tensors "pack-quantized" checkpoint layout (llm-compressor's W4A16 / W8A16
output, quant_method "compressed-tensors"; docs/quantization-formats.md), read into the GPTQ
layout `GPTQLinear` holds. The config is parsed in quantization/compressed_tensors.py.

Per linear layer of `in` inputs and `out` outputs, `bits` ∈ {4, 8}, pack = 32 / bits:

    weight_packed     int32 [out, in / pack]     codes packed along the INPUT dim
    weight_scale      float [out, groups]        groups = 1 for strategy "channel"
    weight_shape      int   [2]                  [out, in]
    weight_zero_point int32 [out / pack, groups] asymmetric only: packed along the OUTPUT dim
    weight_g_idx      int   [in]                 actorder "group" only: each input's group

compressed-tensors quantizes to signed integers, q ∈ [-2^(bits-1), 2^(bits-1)), with signed zero
points (0 when symmetric), w = (q - zp) * scale, and packs both offset by 2^(bits-1) into [0,
2^bits), `pack` values per int32 word, the first in the lowest bits (`pack_to_int32`). Offset
codes and offset zero points have the same difference, so they are exactly GPTQ's codes and
zero points (symmetric: zero 2^(bits-1)), and the words are GPTQ's words transposed: GPTQ packs
`qweight` along the input and `qzeros` along the output too. Checked against compressed-tensors'
compressors/quantized_compressors/pack_quantized.py (`compress_weight`/`compress_module`,
`pack_to_int32`, `unpack_from_int32`) and vLLM's compressed_tensors_wNa16.py, which feeds
`weight_packed.t()` to its GPTQ kernels."""
from __future__ import annotations

import torch

from kvslim.errors import WeightsError
from kvslim.formats.gptq import group_index
from kvslim.quantization.base import QuantSpec
from kvslim.quantization.gptq import pack_int32, unpack_int32


def pack_to_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Signed codes (or zero points) -> int32 words as compressed-tensors stores them: offset by
    2^(bits-1), 32 / bits consecutive values along `dim` per word, the first lowest."""
    return pack_int32(values.to(torch.int64) + 2 ** (bits - 1), bits, dim)


def unpack_from_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `pack_to_int32`: signed int64 values."""
    return unpack_int32(words, bits, dim) - 2 ** (bits - 1)


def stored_shapes(spec: QuantSpec, out_features: int, in_features: int
                  ) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each stored tensor of one layer: its shape and kind of dtype."""
    groups = spec.num_groups(in_features)
    shapes = {"weight_packed": ((out_features, in_features // spec.pack), "int32"),
              "weight_scale": ((out_features, groups), "float"),
              "weight_shape": ((2,), "int")}
    if not spec.sym:
        shapes["weight_zero_point"] = ((out_features // spec.pack, groups), "int32")
    if spec.desc_act:
        shapes["weight_g_idx"] = ((in_features,), "int")
    return shapes


def leaves(spec: QuantSpec) -> tuple[str, ...]:
    """The tensors one layer stores (zero points only when asymmetric: compressed-tensors saves
    none for a symmetric scheme)."""
    return (("weight_packed", "weight_scale", "weight_shape")
            + (() if spec.sym else ("weight_zero_point",))
            + (("weight_g_idx",) if spec.desc_act else ()))


def to_gptq(prefix: str, tensors: dict[str, torch.Tensor], spec: QuantSpec
            ) -> dict[str, torch.Tensor]:
    """One layer's tensors (shapes checked) as GPTQ-layout tensors: the same words transposed,
    zero points 2^(bits-1) when symmetric, g_idx in input order unless stored."""
    packed = tensors["weight_packed"]
    out_features, in_features = packed.shape[0], packed.shape[1] * spec.pack
    shape = [int(v) for v in tensors["weight_shape"]]
    if shape != [out_features, in_features]:
        raise WeightsError(f"{prefix}.weight_shape is {shape}, expected "
                           f"{[out_features, in_features]} from config.json")
    scales = tensors["weight_scale"].t().contiguous()                  # [groups, out]
    if spec.sym:
        zeros = torch.full(scales.shape, 2 ** (spec.bits - 1), dtype=torch.int64)
        qzeros = pack_int32(zeros, spec.bits, dim=1)
    else:
        qzeros = tensors["weight_zero_point"].t().contiguous()
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None and not bool(((g_idx >= 0) & (g_idx < scales.shape[0])).all()):
        raise WeightsError(f"{prefix}.weight_g_idx names groups outside 0 … "
                           f"{scales.shape[0] - 1}")
    return {"qweight": packed.t().contiguous(),
            "qzeros": qzeros,
            "scales": scales,
            "g_idx": (group_index(in_features, spec.group_size) if g_idx is None
                      else g_idx.to(torch.int32))}


def from_gptq(tensors: dict[str, torch.Tensor], spec: QuantSpec) -> dict[str, torch.Tensor]:
    """The inverse of `to_gptq`, for writing: one layer's GPTQ tensors (`pack_gptq`'s, no
    act-order) as pack-quantized ones. Symmetric: no zero point is stored, every group's must
    be 2^(bits-1)."""
    zeros = spec.zeros_from_stored(unpack_int32(tensors["qzeros"], spec.bits, dim=1))
    if spec.desc_act or (spec.sym and bool((zeros != 2 ** (spec.bits - 1)).any())):
        raise ValueError("pack-quantized is written for groups in input order, symmetric "
                         "ones with their zero point at 2^(bits-1)")
    packed = tensors["qweight"].t().contiguous()
    out = {"weight_packed": packed,
           "weight_scale": tensors["scales"].t().contiguous(),
           "weight_shape": torch.tensor([packed.shape[0], packed.shape[1] * spec.pack])}
    if not spec.sym:
        out["weight_zero_point"] = pack_int32(zeros, spec.bits, dim=1).t().contiguous()
    return out
