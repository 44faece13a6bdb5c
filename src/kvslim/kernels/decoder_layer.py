"""A decoder layer (Llama family, Qwen3, Gemma 3) in one native call
(`torch.ops.kvslim.decoder_layer`, csrc/decoder_layer.cpp), or all of a step's layers in one
(`decoder_stack`): the kernels the layer's modules would call one by one — the norms, the
int8-activation GEMMs, RoPE, the cache writes, the paged attention kernel, the gate's activation
and the residual adds — in the same order, so the same bits, without the Python and the dispatch
between them. `rms_norm` is the one RMSNorm kernel both paths run.

Taken by a layer whose four linears run kvslim's int8-activation kernel without a bias, whose
norms are RMSNorm or Gemma's and whose MLP is gated (SiLU or tanh GELU), in a step whose
attention goes through the kernel over a float32 cache (`PagedAttention.native_inputs`); any
other layer or step runs the modules."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from kvslim.kernels import extension
from kvslim.kernels.group_q8 import Q8GroupWeight

FAKES = {"rms_norm": lambda x, weight, eps: torch.empty_like(x),
         "decoder_layer": lambda x, *args: torch.empty_like(x),
         "decoder_stack": lambda x, *args: torch.empty_like(x)}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}       # the ops' `act`


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
    the six norms (csrc's order: before attention, on its output, before the MLP, on its output,
    per query head, per key head; None where the layer has none) and the attention's shape."""
    weights: list[torch.Tensor]          # qweight, scales of each, in order
    extras: list[torch.Tensor | None]    # mins (4-bit) or column sums (8-bit) of each
    bits: list[int]
    outs: list[int]
    norms: list[torch.Tensor | None]
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    act: int
    # LoRA adapters (lora/layer.py attaches them): the step's slots holder (its token_slots,
    # None in a step without adapters), A and B of qkv, o, gate_up and down, their 7 shards.
    lora: LayerAdapters | None = None

    @classmethod
    def of(cls, linears: list[Q8GroupWeight], norms: list[torch.Tensor | None], eps: float,
           heads: int, kv_heads: int, head_dim: int, scale: float, act: str) -> NativeDecoderLayer:
        return cls([t for w in linears for t in (w.qweight, w.scales)],
                   [w.mins if w.bits == 4 else w.colsum for w in linears],
                   [w.bits for w in linears], [w.out_features for w in linears], norms, eps,
                   heads, kv_heads, head_dim, scale, ACTIVATIONS[act])

    def shape(self) -> tuple:
        """What a stack's layers must share (the op takes it once)."""
        return self.eps, self.heads, self.kv_heads, self.head_dim, self.scale, self.act

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attention: tuple) -> torch.Tensor:
        """x [N, hidden]; `attention`: PagedAttention.native_inputs' tuple."""
        k_cache, v_cache, slots, tables, lens, key_start, window, demoted = attention
        return torch.ops.kvslim.decoder_layer(
            x.contiguous(), self.weights, self.extras, self.bits, self.outs, self.norms, self.eps,
            self.heads, self.kv_heads, self.head_dim, self.act, cos, sin, k_cache, v_cache,
            slots, tables, lens, key_start, window, self.scale, *adapter_args([self.lora]),
            demoted)


@dataclass
class NativeDecoderStack:
    """Every layer of a step in one native call (`torch.ops.kvslim.decoder_stack`): the
    layers' own calls one after another, in one hold of torch's threads (csrc/thread_team.h)
    rather than one a layer, whose wake-ups cost more than the Python between them."""
    layers: list[NativeDecoderLayer]
    weights: list[torch.Tensor]
    extras: list[torch.Tensor | None]
    bits: list[int]
    outs: list[int]
    norms: list[torch.Tensor | None]

    @classmethod
    def of(cls, layers: list[NativeDecoderLayer | None]) -> NativeDecoderStack | None:
        """None unless every layer is native and all share what the op takes once."""
        if not layers or any(n is None or n.shape() != layers[0].shape() for n in layers):
            return None
        return cls(layers, [t for n in layers for t in n.weights],
                   [t for n in layers for t in n.extras], [b for n in layers for b in n.bits],
                   [o for n in layers for o in n.outs], [t for n in layers for t in n.norms])

    def inputs(self, modules, x: torch.Tensor, attn) -> list[tuple] | None:
        """Each layer's `native_inputs` for this step, or None where the stack cannot run it:
        a layer no longer native (a benchmark switched it off), a batch that is not [N, hidden],
        a traced step, an attention without the kernel path for every layer."""
        if (x.dim() != 2 or torch.compiler.is_compiling()
                or any(m.native is not n for m, n in zip(modules, self.layers))):
            return None
        native_inputs = getattr(attn, "native_inputs", None)
        if native_inputs is None:
            return None
        inputs = [native_inputs(m.self_attn.layer_idx) for m in modules]
        return None if any(i is None for i in inputs) else inputs

    def __call__(self, x: torch.Tensor, cos: list[torch.Tensor], sin: list[torch.Tensor],
                 inputs: list[tuple]) -> torch.Tensor:
        """cos, sin: each layer's; inputs: `inputs()`."""
        n = self.layers[0]
        k, v, slots, tables, lens, starts, windows, demoted = (list(c) for c in zip(*inputs))
        return torch.ops.kvslim.decoder_stack(
            x.contiguous(), self.weights, self.extras, self.bits, self.outs, self.norms, n.eps,
            n.heads, n.kv_heads, n.head_dim, n.act, cos, sin, k, v, slots, tables, lens, starts,
            windows, n.scale, *adapter_args([layer.lora for layer in self.layers]),
            [] if all(d is None for d in demoted) else demoted)


@dataclass
class LayerAdapters:
    """A native layer's LoRA adapters (lora/layer.py's LoRALinear buffers, shared)."""
    batch: object                        # its token_slots: each row's slot, or None
    tensors: list[torch.Tensor]          # A, B of qkv, o, gate_up, down
    shards: list[int]                    # their output shards' rows (3, 1, 2, 1 of them)


def adapter_args(adapters: list[LayerAdapters | None]) -> tuple:
    """The ops' trailing LoRA arguments for these layers: no slots in a step without adapters,
    else the slots, every layer's tensors and the shards."""
    first = adapters[0]
    if first is None or first.batch.token_slots is None:
        return None, [], []
    return (first.batch.token_slots, [t for a in adapters for t in a.tensors], first.shards)
