"""Which model class runs a config: the Llama decoder for the Llama family (Llama, Mistral,
Qwen2, Qwen3, Phi-3, and the MoE ones, Mixtral and Qwen3-MoE), Gemma 3's own arrangement of the
same pieces."""
from __future__ import annotations

from kvslim.models.config import ModelConfig
from kvslim.models.gemma3 import Gemma3ForCausalLM
from kvslim.models.llama import LlamaForCausalLM


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    config.require_runnable()
    return Gemma3ForCausalLM if config.model_type == "gemma3_text" else LlamaForCausalLM
