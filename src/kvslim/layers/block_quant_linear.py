"""Linear layers holding llama.cpp's 4-bit block weights (Q4_0, Q4_1) as they are stored, so a
GGUF file's linear layers load without re-quantizing (docs/quantization-formats.md):

    qvalues uint8 [out, in]        4-bit values 0..15, one per byte
    scales        [out, in / 32]   d of each block of 32 inputs
    mins          [out, in / 32]   m of each block: Q4_1 stores it, Q4_0's is -8 * d

w[o, i] = qvalues[o, i] * scales[o, i // 32] + mins[o, i // 32], which is llama.cpp's own
dequantization (Q4_0: d * (q - 8); Q4_1: d * q + m) in the same float32 arithmetic. Blocks run
along the input dim, so every tensor is row-major over the outputs: fused layers (q/k/v,
gate/up) concatenate their shards' rows. `prepare_for_inference` packs the weight for
`int4_linear` with scale d and the float zero point -m / d (0 where d is 0)."""
from __future__ import annotations

from functools import partial
from typing import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.errors import ConfigError
from kvslim.layers.quant_kernels import pack_int4
from kvslim.layers.quant_linear import QuantLinear, QuantSpec, _int4_forward

BLOCK = 32
BLOCK_LEAVES = ("qvalues", "scales", "mins", "bias")


class BlockQuantLinear(QuantLinear):
    """A linear layer of 4-bit blocks; shards (named as in QuantQKVLinear and QuantMergedLinear:
    "q"/"k"/"v", or "gate"/"up" also reachable as 0/1) are stacked along the output."""
    LEAVES = BLOCK_LEAVES

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 spec: QuantSpec | None = None, shard_sizes: dict[Hashable, int] | None = None):
        nn.Module.__init__(self)
        if spec is None:
            raise ValueError("BlockQuantLinear needs a QuantSpec")
        if in_features % BLOCK:
            raise ConfigError(f"a 4-bit block layer needs inputs divisible by {BLOCK}, "
                              f"got {in_features}")
        self.spec = spec
        self.shard_sizes = dict(shard_sizes or {None: out_features})
        self.in_features, self.out_features = in_features, sum(self.shard_sizes.values())
        out, blocks = self.out_features, in_features // BLOCK
        self.register_buffer("qvalues", torch.zeros(out, in_features, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(out, blocks))
        self.register_buffer("mins", torch.zeros(out, blocks))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None
        self.kernel = None

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] in the scales' dtype."""
        q = self.qvalues.to(self.scales.dtype).view(self.out_features, -1, BLOCK)
        w = q * self.scales.unsqueeze(-1) + self.mins.unsqueeze(-1)
        return w.view(self.out_features, self.in_features)

    def zero_points(self) -> torch.Tensor:
        """-m / d per block (0 where d is 0: such a block is all m, which is 0 in Q4_0 and, in
        Q4_1, what llama.cpp's quantizer stores only for an all-zero block)."""
        d, m = self.scales.float(), self.mins.float()
        return torch.where(d == 0, torch.zeros_like(d), -m / torch.where(d == 0, 1.0, d))

    @torch.no_grad()
    def prepare_for_inference(self) -> None:
        """Pack for `int4_linear` (bfloat16 activations on CPU, see layers/quant_kernels.py)."""
        if self.qvalues.device.type != "cpu":
            dense = self.dequantized_weight()
            self.kernel = partial(_dense_forward, weight=dense, bias=self.bias)
            return
        weight = pack_int4(self.qvalues, self.scales.float(), self.zero_points(), BLOCK)
        self.kernel = partial(_int4_forward, weight=weight, perm=None, bias=self.bias)

    def shard_key(self, shard_id: Hashable) -> Hashable:
        if isinstance(shard_id, int):
            return list(self.shard_sizes)[shard_id]
        return shard_id

    def shard_view(self, leaf: str, shard_id: Hashable) -> torch.Tensor:
        """The rows of buffer `leaf` that hold one shard, as a view."""
        _, rows = self._shard(shard_id)
        return getattr(self, leaf)[rows]


def _dense_forward(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype), bias)
