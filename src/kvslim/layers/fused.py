"""Inference-time module swap: one GEMM for q/k/v and one for gate/up, RoPE applied to q and k in
one call. Fewer, larger operations per layer — on a CPU decode step, where each op costs a few
microseconds of framework overhead, this is a measurable share of the step. Training, surgery and
saving keep the HF layout; only the engine's model is fused."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.layers.self_attention import Attention
from kvslim.layers.mlp import SwiGLUMLP
from kvslim.models.llama import LlamaForCausalLM
from kvslim.layers.rope import apply_rope


def _concat_linear(linears: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([l.weight.data for l in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
    fused.weight.data.copy_(w)
    if has_bias:
        fused.bias.data.copy_(torch.cat([l.bias.data for l in linears]))
    return fused


class FusedAttention(nn.Module):
    def __init__(self, attn: Attention):
        super().__init__()
        self.layer_idx, self.scale = attn.layer_idx, attn.scale
        self.num_heads, self.num_kv_heads, self.head_dim = (attn.num_heads, attn.num_kv_heads,
                                                            attn.head_dim)
        self.qkv_proj = _concat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        lead = x.shape[:-1]
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(*lead, h + 2 * kv, self.head_dim)
        qk = apply_rope(qkv[..., :h + kv, :], cos, sin)
        q, k, v = qk[..., :h, :], qk[..., h:, :], qkv[..., h + kv:, :]
        out = attn.attend(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(*lead, h * self.head_dim))


class FusedMLP(nn.Module):
    def __init__(self, mlp: SwiGLUMLP):
        super().__init__()
        self.intermediate = mlp.gate_proj.out_features
        self.gate_up_proj = _concat_linear([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fuse_for_inference(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Swap every layer's attention projections and MLP for their fused forms, in place."""
    for layer in model.model.layers:
        if isinstance(layer.self_attn, Attention):
            layer.self_attn = FusedAttention(layer.self_attn)
        if isinstance(layer.mlp, SwiGLUMLP):
            layer.mlp = FusedMLP(layer.mlp)
    return model
