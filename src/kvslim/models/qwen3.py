"""Qwen3: Qwen2's decoder with each query and key head RMS-normalised before RoPE (`Attention`'s
q_norm / k_norm), and its attention biases set by `attention_bias` again."""
from __future__ import annotations

from typing import Any

from kvslim.models import qwen2
from kvslim.models.base import QK_NORM_TENSORS, Family, GGUFLayout
from kvslim.models.llama import LLAMA_LAYER_TENSORS, LlamaForCausalLM


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, "sliding_window": qwen2.sliding_window(cfg)}


def gguf_fields(key, optional, head_dim: int) -> dict[str, Any]:
    return {"qk_norm": True}


LAYER_TENSORS = {**LLAMA_LAYER_TENSORS, **QK_NORM_TENSORS}
FAMILY = Family("qwen3", "Qwen3ForCausalLM", "Qwen3", LlamaForCausalLM, hf_fields=hf_fields,
                gguf=GGUFLayout("qwen3", LAYER_TENSORS, fields=gguf_fields))
