"""A Llama-family decoder layer in one native call (`torch.ops.kvslim.llama_decoder_layer`,
csrc/decoder_layer.cpp): the kernels the layer's modules would call one by one — RMSNorm, the
int8-activation GEMMs, RoPE, the cache writes, the paged attention kernel, SiLU and the residual
adds — in the same order, so the same bits, without the Python and the dispatch between them.
`rms_norm` is the one RMSNorm kernel both paths run.

Taken by a layer whose four linears run kvslim's int8-activation kernel without a bias, whose
norms are plain RMSNorm and whose MLP is SwiGLU, in a step whose attention goes through the
kernel over a float32 cache (`PagedAttention.native_inputs`); any other layer or step runs the
modules."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from kvslim.kernels import extension
from kvslim.kernels.group_q8 import Q8GroupWeight

FAKES = {"rms_norm": lambda x, weight, eps: torch.empty_like(x),
         "llama_decoder_layer": lambda x, *args: torch.empty_like(x)}


@cache
def available() -> bool:
    return extension.ensure(FAKES)


def rms_norm_usable(x: torch.Tensor) -> bool:
    """Inference on the CPU in float32 (the kernel has no backward). Whether the extension is
    built is asked once, where a norm is marked native (DecoderLayer.prepare_native), not here:
    a compiled step traces this and may not call the cached probe."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = (x / sqrt(mean(x^2) + eps)) * weight per row, each row's sum in one fixed order."""
    return torch.ops.kvslim.rms_norm(x, weight, eps)


@dataclass
class NativeDecoderLayer:
    """What the op takes besides the step's inputs: the four weights (qkv, o, gate_up, down),
    the two norms and the attention's shape."""
    weights: list[torch.Tensor]          # qweight, scales of each, in order
    extras: list[torch.Tensor | None]    # mins (4-bit) or column sums (8-bit) of each
    bits: list[int]
    outs: list[int]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scale: float

    @classmethod
    def of(cls, linears: list[Q8GroupWeight], input_norm: torch.Tensor,
           post_norm: torch.Tensor, eps: float, heads: int, kv_heads: int, head_dim: int,
           scale: float) -> NativeDecoderLayer:
        return cls([t for w in linears for t in (w.qweight, w.scales)],
                   [w.mins if w.bits == 4 else w.colsum for w in linears],
                   [w.bits for w in linears], [w.out_features for w in linears],
                   input_norm.detach(), post_norm.detach(), eps, heads, kv_heads, head_dim,
                   scale)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attention: tuple) -> torch.Tensor:
        """x [N, hidden]; `attention`: PagedAttention.native_inputs' tuple."""
        k_cache, v_cache, slots, tables, lens, key_start, window = attention
        return torch.ops.kvslim.llama_decoder_layer(
            x.contiguous(), self.weights, self.extras, self.bits, self.outs, self.input_norm,
            self.post_norm, self.eps, self.heads, self.kv_heads, self.head_dim, cos, sin,
            k_cache, v_cache, slots, tables, lens, key_start, window, self.scale)
