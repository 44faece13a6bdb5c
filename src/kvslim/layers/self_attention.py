"""The attention block of a decoder layer: projections and RoPE here, the attention itself in the
backend context the caller passes in (`kvslim.attention`)."""
from __future__ import annotations

import torch
from torch import nn

from kvslim.models.config import ModelConfig
from kvslim.layers.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=config.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        """x [..., hidden] where ... is [B, T] (dense) or [N] (paged); attn is the backend context."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn.attend(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))
