"""The gated feed-forward block of Llama-family layers: down(act(gate(x)) * up(x)), with gate
and up computed by one GEMM; act is SiLU (SwiGLU) or, for Gemma, tanh-approximated GELU (GeGLU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.layers.block_quant_linear import BlockQuantLinear
from kvslim.layers.linear import Linear, MergedLinear
from kvslim.layers.quant_linear import QuantLinear, QuantMergedLinear, QuantSpec
from kvslim.layers.w8a8_linear import W8A8Linear

ROW_MAJOR = {"gguf": BlockQuantLinear, "w8a8": W8A8Linear}   # shards stacked as rows


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config.json hidden_act / hidden_activation -> the gate's activation
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 quant: QuantSpec | None = None, activation: str = "silu"):
        super().__init__()
        self.intermediate = intermediate
        self.act = ACTIVATIONS[activation]
        if quant is None:
            self.gate_up_proj = MergedLinear(hidden, ("gate", "up"), intermediate, bias=bias)
            self.down_proj = Linear(intermediate, hidden, bias=bias)
        elif quant.method in ROW_MAJOR:
            cls = ROW_MAJOR[quant.method]
            self.gate_up_proj = cls(hidden, 0, bias, quant,
                                    {"gate": intermediate, "up": intermediate})
            self.down_proj = cls(intermediate, hidden, bias, quant)
        else:
            self.gate_up_proj = QuantMergedLinear(hidden, ("gate", "up"), intermediate, bias,
                                                  quant)
            self.down_proj = QuantLinear(intermediate, hidden, bias, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)
