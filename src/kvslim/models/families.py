"""The model families kvslim knows, registered once. Each family's file in models/ declares
its `Family` (models/base.py: its config fields, model class, checkpoint-name rule, GGUF layout
and what it supports); this list is where a new one is added. Code outside models/ asks
`family_of(config)` instead of testing architecture names."""
from __future__ import annotations

from kvslim.models import (deepseek_v2, deepseek_v3, gemma3, llama, mistral, mixtral, phi3,
                           qwen2, qwen3, qwen3_moe)
from kvslim.models.base import Family
from kvslim.models.config import BY_ARCHITECTURE, ModelConfig, register_families

# In this order in messages (the architectures kvslim supports, the GGUF ones it imports)
FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY,
                                gemma3.FAMILY, phi3.FAMILY, mixtral.FAMILY, qwen3_moe.FAMILY,
                                deepseek_v2.FAMILY, deepseek_v3.FAMILY)
register_families(FAMILIES)                  # BY_ARCHITECTURE, ModelConfig's table
# The families some jobs are about, named here so that code outside models/ asks for the role:
# what `kvslim train` builds from scratch, what `kvslim convert --to-mla` writes and reads.
TRAINED_FAMILY = llama.FAMILY
MLA_FAMILY = deepseek_v2.FAMILY
MLA_SOURCES = tuple(f for f in FAMILIES if f.converts_to_mla)


def family_of(config: ModelConfig) -> Family:
    return BY_ARCHITECTURE[config.architecture]


def model_class(config: ModelConfig) -> type[llama.LlamaForCausalLM]:
    """Which model class runs a config: the Llama decoder for most families, Gemma 3's and
    DeepSeek's own arrangements of the same pieces."""
    config.require_runnable()
    return family_of(config).model_class
