"""The compressed-tensors `int-quantized` W8A8 layout that vLLM reads (docs/quantization-formats.md):
config.json's `quantization_config` and each quantized linear's tensors.

    <module>.weight        int8    [out, in]   symmetric codes
    <module>.weight_scale  float32 [out, 1]    one scale per output channel: w = weight * scale

Activations are quantized per token at run time (`dynamic: true`), so nothing is stored for them.
Some compressed-tensors versions also store `<module>.weight_zero_point` for symmetric schemes,
all zeros: read and checked, then dropped (`is_symmetric_zero_point`).
The layer that reads these tensors and the scheme's constants are `kvslim.quantization.w8a8`; the
config is parsed in quantization/compressed_tensors.py (format "int-quantized")."""
from __future__ import annotations

import torch

from kvslim.errors import WeightsError
from kvslim.formats.gptq import QuantizedWeight
from kvslim.quantization.base import QuantSpec
from kvslim.quantization.w8a8 import FORMAT, INPUTS, WEIGHTS


ZERO_POINT = ".weight_zero_point"


def is_symmetric_zero_point(spec: QuantSpec | None, name: str, read) -> bool:
    """True for a W8A8 checkpoint's `weight_zero_point` tensor, which the loader then skips
    (`read()` gives the tensor); one that is not all zeros contradicts `symmetric: true`."""
    if spec is None or spec.method != "w8a8" or not name.endswith(ZERO_POINT):
        return False
    if bool(read().ne(0).any()):
        raise WeightsError(f"{name} is not all zeros, but the quantization_config says "
                           "symmetric: true")
    return True




def pack_w8a8(weight: QuantizedWeight, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """The tensors of one matrix quantized with one symmetric group per output row (codes in
    [0, 256) around a zero point, as rtn/gptq produce them): int8 `weight`, `weight_scale`."""
    if weight.scales.shape[0] != 1:
        raise ValueError(f"W8A8 takes one scale per output channel, got "
                         f"{weight.scales.shape[0]} groups")
    codes = weight.q - weight.zeros[0][:, None].to(weight.q.dtype)
    if int(codes.min()) < -128 or int(codes.max()) > 127:
        raise ValueError("W8A8 codes must fit int8")
    return {"weight": codes.to(torch.int8).contiguous(),
            "weight_scale": weight.scales[0].float().reshape(-1, 1).contiguous()}
