"""Qwen2: the Llama decoder (models/llama.py) with biases on the q, k and v projections (none on
o, whatever `attention_bias` says), and a sliding window only where `use_sliding_window` turns it
on (off unless set)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvslim.models.base import Family, GGUFLayout
from kvslim.models.llama import LLAMA_LAYER_TENSORS, LlamaForCausalLM

if TYPE_CHECKING:
    from kvslim.models.config import ModelConfig


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """Qwen's configs name a window that applies only under `use_sliding_window`."""
    return cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None


def _hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": True, "o_bias": False, "sliding_window": sliding_window(cfg)}


def _write_hf(config: ModelConfig, cfg: dict[str, Any]) -> None:
    """Nothing beyond the common keys: Qwen2's biases are its architecture's, not a flag."""


FAMILY = Family("qwen2", "Qwen2ForCausalLM", "Qwen2", LlamaForCausalLM, hf_fields=_hf_fields,
                write_hf=_write_hf, gguf=GGUFLayout("qwen2", LLAMA_LAYER_TENSORS))
