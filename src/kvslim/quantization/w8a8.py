"""W8A8 linear layers: int8 weights with one scale per output channel, and activations quantized
to int8 per token (row) at run time, held in the compressed-tensors `int-quantized` layout that
vLLM reads (docs/quantization-formats.md):

    weight        int8  [out, in]   symmetric codes, w[o, i] = weight[o, i] * weight_scale[o]
    weight_scale        [out, 1]    one scale per output channel
    bias                [out]       optional

Weights are row-major over the outputs, so fused layers (q/k/v, gate/up) stack their shards'
rows and their scales alike. The product runs in integers (`w8a8_linear`): each output row is
(sum_i xq[i] * wq[o, i]) * sx * sw[o], exact in int32, so a row's result does not depend on
which other rows share the call (the batch). config.json's `quantization_config` for this layout
is read by compressed_tensors.py (format "int-quantized"); its constants are here, where the
layer that runs the scheme is (formats/compressed_tensors_int.py writes them)."""
from __future__ import annotations

from functools import partial
from typing import Hashable

import torch

from kvslim.quantization.base import QuantLinear, QuantSpec
from kvslim.quantization.kernels import pack_w8a8, w8a8_linear
from kvslim.quantization.registry import register

W8A8_LEAVES = ("weight", "weight_scale", "bias")
FORMAT = "int-quantized"
# The only scheme read: what `kvslim quantize --method w8a8` writes and vLLM's W8A8 int8 runs.
WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
W8A8_SPEC = QuantSpec(8, -1, sym=True, checkpoint_format=FORMAT, method="w8a8")


class W8A8Linear(QuantLinear):
    """A W8A8 linear layer; shards ("q"/"k"/"v", or "gate"/"up" also reachable as 0/1) are
    stacked along the output, row major."""
    LEAVES = W8A8_LEAVES

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 spec: QuantSpec | None = None, shard_sizes: dict[Hashable, int] | None = None):
        super().__init__(in_features, out_features, bias, spec, shard_sizes)
        self.register_buffer("weight", torch.zeros(self.out_features, in_features,
                                                   dtype=torch.int8))
        # Scales follow the model's dtype (`.to(dtype)` leaves the int8 weight alone); the
        # kernel rescales in float32 whatever it is.
        self.register_buffer("weight_scale", torch.zeros(self.out_features, 1))

    def unprepared_forward(self, x: torch.Tensor) -> torch.Tensor:
        return w8a8_linear(x, self.weight, self.weight_scale.view(-1), self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] in float32."""
        return self.weight.float() * self.weight_scale.float()

    @torch.no_grad()
    def prepare_for_inference(self) -> None:
        """Every row count runs the integer product: `kvslim bench kernels` had it faster than
        int8 weight-only on the same weight from 4 rows and even at 1, and one kernel at every
        M keeps a row's result independent of its batch (kernels.W8A8_MIN_ROWS). On a CPU
        with kvslim's kernels, their VNNI form (the same bits, faster: kernels.pack_w8a8)."""
        weight, scales = self.weight.contiguous(), self.weight_scale.view(-1).contiguous()
        self.kernel = partial(w8a8_linear, qweight=weight, scales=scales, bias=self.bias,
                              packed=pack_w8a8(weight, scales))


def w8a8_config(spec: QuantSpec = W8A8_SPEC) -> dict:
    """config.json's quantization_config: the fields llm-compressor writes for its W8A8 int8
    scheme (one group for every Linear, lm_head left out)."""
    common = {"actorder": None, "block_structure": None, "group_size": None, "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors", "format": FORMAT,
        "quantization_status": "compressed", "kv_cache_scheme": None, "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {**common, **WEIGHTS, "dynamic": False, "observer": "minmax"},
            "input_activations": {**common, **INPUTS, "observer": "memoryless"},
        }},
    }


register("w8a8", W8A8Linear, write=w8a8_config)
