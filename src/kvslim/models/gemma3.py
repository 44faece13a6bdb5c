"""Gemma 3 (text): the Llama decoder's pieces arranged Gemma's way.

- embeddings scaled by sqrt(hidden_size), tied LM head;
- RMSNorm with a (1 + w) weight (`GemmaRMSNorm`), around both sublayers: input and
  post-attention norms, pre- and post-feed-forward norms;
- q and k heads normalised before RoPE, logits scaled by query_pre_attn_scalar ** -0.5;
- GeGLU feed-forward (tanh-approximated GELU);
- local layers (a sliding window, RoPE base `rope_local_theta`) between global ones (the whole
  context, `rope_theta` with its scaling), as `layer_types` says.

Checkpoint names are the Llama family's plus the two feed-forward norms, so loading, surgery and
writing reuse `LlamaForCausalLM`'s rule unchanged."""
from __future__ import annotations

import torch
from torch import nn

from kvslim.layers.linear import Linear
from kvslim.layers.mlp import SwiGLUMLP
from kvslim.layers.norm import GemmaRMSNorm
from kvslim.layers.rope import RotaryEmbedding
from kvslim.layers.self_attention import Attention
from kvslim.models.config import ModelConfig
from kvslim.models.llama import LlamaForCausalLM


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.layer_sliding_windows[layer_idx] is not None
        self.self_attn = Attention(h, config.num_attention_heads, config.kv_heads_of(layer_idx),
                                   config.head_dim, layer_idx, config.qkv_bias, config.o_bias,
                                   config.quantization, qk_norm_eps=eps,
                                   qk_norm_cls=GemmaRMSNorm,
                                   scale=float(config.query_pre_attn_scalar) ** -0.5)
        self.mlp = SwiGLUMLP(h, config.intermediate_size, config.mlp_bias, config.quantization,
                             activation=config.hidden_act)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, rope, attn):
        cos, sin = rope["local" if self.is_sliding else "global"]
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos, sin, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.quantization is not None and config.quantization.embedding:
            raise NotImplementedError("quantized Gemma 3 embeddings")   # caught by the loader
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.local_rotary = RotaryEmbedding(config.head_dim, config.rope_local_theta, None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                long_rope: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers scales by the square root rounded to the embeddings' dtype
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = {"global": self.rotary.cos_sin(positions, x.dtype, long_rope),
                "local": self.local_rotary.cos_sin(positions, x.dtype)}
        for layer in self.layers:
            x = layer(x, rope, attn)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
