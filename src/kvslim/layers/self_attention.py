"""The attention block of a decoder layer: projections and RoPE here, the attention itself in the
backend context the caller passes in (`kvslim.attention`). q, k and v come from one GEMM and RoPE
rotates q and k in one call: fewer, larger operations per layer."""
from __future__ import annotations

import torch
from torch import nn

from kvslim.layers.linear import LinearQuantization, make_linear
from kvslim.layers.norm import RMSNorm
from kvslim.layers.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 layer_idx: int, qkv_bias: bool = False, o_bias: bool = False,
                 quant: LinearQuantization | None = None, qk_norm_eps: float | None = None,
                 qk_norm_cls: type[nn.Module] = RMSNorm, scale: float | None = None):
        """qk_norm_eps: normalise each query and key head (`qk_norm_cls` over head_dim, one
        weight for all query heads and one for all key heads) before RoPE, as Qwen3 and Gemma 3
        do. scale: the attention logits' factor (default head_dim ** -0.5)."""
        super().__init__()
        if qk_norm_eps is not None:
            self.q_norm = qk_norm_cls(head_dim, qk_norm_eps)
            self.k_norm = qk_norm_cls(head_dim, qk_norm_eps)
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        qkv = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
               "v": num_kv_heads * head_dim}
        self.qkv_proj = make_linear(hidden_size, qkv, qkv_bias, quant)
        self.o_proj = make_linear(num_heads * head_dim, hidden_size, o_bias, quant)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        """x [..., hidden] where ... is [B, T] (dense) or [N] (paged); attn is the backend context."""
        lead = x.shape[:-1]
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(*lead, h + 2 * kv, self.head_dim)
        qk = qkv[..., :h + kv, :]
        if hasattr(self, "q_norm"):
            qk = torch.cat([self.q_norm(qk[..., :h, :]), self.k_norm(qk[..., h:, :])], dim=-2)
        qk = apply_rope(qk, cos, sin)
        q, k, v = qk[..., :h, :], qk[..., h:, :], qkv[..., h + kv:, :]
        out = attn.attend(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(*lead, h * self.head_dim))
