"""One GQA-native decoder for the Llama family (Llama, Mistral, Qwen2). Parameter names follow
HF transformers, so state dicts load and save without a mapping."""
from __future__ import annotations

import torch
from torch import nn

from kvslim.attention import DenseAttention
from kvslim.layers.self_attention import Attention
from kvslim.models.config import ModelConfig
from kvslim.layers.mlp import SwiGLUMLP
from kvslim.layers.norm import RMSNorm
from kvslim.layers.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn=None, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm. Without `attn`, input_ids is a dense [B, T] batch
        attended causally (with `padding_mask` [B, T] marking real tokens, if any)."""
        if attn is None:
            attn = DenseAttention(input_ids.shape[-1], input_ids.device, padding_mask,
                                  self.config.sliding_window)
        if positions is None:
            positions = default_positions(input_ids, padding_mask)
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def logits(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Convenience for training and evaluation: [B, T] ids -> [B, T, vocab] logits."""
        return self.compute_logits(self(input_ids, padding_mask=padding_mask))


def default_positions(input_ids: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    if padding_mask is None:
        return torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    # Left padding: each row's first real token is position 0.
    return (padding_mask.long().cumsum(-1) - 1).clamp(min=0)
