"""The gated feed-forward block of Llama-family layers: down(act(gate(x)) * up(x)), with gate
and up computed by one GEMM; act is SiLU (SwiGLU) or, for Gemma, tanh-approximated GELU (GeGLU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.layers.linear import LinearQuantization, make_linear


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config.json hidden_act / hidden_activation -> the gate's activation
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}
# the activation -> its name in the native decoder layer (kernels/decoder_layer.py)
GATE_ACTIVATIONS = {F.silu: "silu", _gelu_tanh: "gelu_tanh"}


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 quant: LinearQuantization | None = None, activation: str = "silu"):
        super().__init__()
        self.intermediate = intermediate
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = make_linear(hidden, {"gate": intermediate, "up": intermediate},
                                        bias, quant)
        self.down_proj = make_linear(intermediate, hidden, bias, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)
