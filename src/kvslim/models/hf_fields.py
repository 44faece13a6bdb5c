"""Fields of an HF config.json that need more than a lookup, whatever the family: the RoPE layout
(two spellings), per-layer KV head counts, partial rotary, the activation. A family's own fields
are read in its file (`Family.hf_fields`)."""
from __future__ import annotations

from typing import Any

from kvslim.errors import ConfigError

# Per-layer KV head counts in config.json, under DeciLM's name for them. transformers' own
# Llama classes read only num_key_value_heads, so they cannot load a model that has this key
# (its k/v projections have other shapes than they build): docs/gqa-uptraining.md.
LAYER_KV_HEADS_KEY = "num_key_value_heads_per_layer"


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Both layouts: transformers v5 `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    merged.pop("type", None)
    if merged.get("rope_type") == "su":                 # LongRoPE's first name (Phi-3)
        merged["rope_type"] = "longrope"
    if merged.get("rope_type", "default") == "default":
        return theta, None
    if merged["rope_type"] == "longrope":
        _longrope_defaults(cfg, merged)
    return theta, merged


def _longrope_defaults(cfg: dict[str, Any], scaling: dict[str, Any]) -> None:
    """Phi-3 keeps LongRoPE's original context beside rope_scaling, and its factor is the ratio
    of the two contexts (as transformers derives it)."""
    if scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings")
    old = scaling["original_max_position_embeddings"]
    if scaling.get("factor") is None and old:
        scaling["factor"] = cfg.get("max_position_embeddings", old) / old


def layer_kv_heads_from_hf(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    heads = cfg.get(LAYER_KV_HEADS_KEY)
    if heads is None:
        return None
    if not isinstance(heads, list) or not heads or not all(isinstance(k, int) for k in heads):
        raise ConfigError(f"config.json: {LAYER_KV_HEADS_KEY} must be a list of integers, "
                          f"got {heads!r}")
    return tuple(heads)


def check_rotary_fraction(cfg: dict[str, Any]) -> None:
    """kvslim rotates whole heads; a model that rotates a fraction of each (Phi-3-small,
    partial_rotary_factor < 1) is refused instead of run wrong."""
    fraction = cfg.get("partial_rotary_factor", 1.0)
    if fraction is not None and float(fraction) != 1.0:
        raise ConfigError(f"config.json: partial_rotary_factor {fraction} is not supported "
                          "(kvslim rotates whole heads: 1.0 only)")


SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def activation_from_hf(cfg: dict[str, Any]) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"config.json: hidden activation {act!r} is not supported; kvslim "
                          f"runs {', '.join(SUPPORTED_ACTIVATIONS)}")
    return act
