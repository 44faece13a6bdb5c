"""The `gemma3` GGUF architecture: what llama.cpp's converter does differently from `llama`.

- Four norms per layer and per-head q/k norms, under their own tensor names.
- Norm weights are stored as (1 + w): llama.cpp multiplies by the weight, Gemma by one plus it,
  so the converter adds the one and the importer takes it off again.
- Q and K rows are not permuted: llama.cpp runs Gemma with the same half-split RoPE as HF.
- What the file does not say, llama.cpp fixes for the architecture, and so does this reader:
  every sixth layer is global and the others slide over `attention.sliding_window` tokens, the
  local layers' RoPE base is 10000, and the attention scale is 1 / sqrt(head_dim)."""
from __future__ import annotations

import torch

from kvslim.models.config import ModelConfig

SLIDING_PATTERN = 6           # layers 5, 11, 17, ... are global
LOCAL_ROPE_THETA = 10_000.0


def gemma3_config_fields(num_layers: int, head_dim: int, sliding_window: int | None) -> dict:
    types = tuple("sliding_attention" if (i + 1) % SLIDING_PATTERN else "full_attention"
                  for i in range(num_layers))
    return dict(architecture="Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh",
                layer_types=types, sliding_window=sliding_window, qk_norm=True,
                rope_local_theta=LOCAL_ROPE_THETA, query_pre_attn_scalar=head_dim)


def from_gguf(gguf_name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A dequantized tensor as transformers' Gemma 3 holds it."""
    if gguf_name.endswith("norm.weight"):
        return weight - 1.0
    return weight
