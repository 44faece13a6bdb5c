"""Fields of an HF config.json that need more than a lookup: the RoPE layout (two spellings),
per-layer KV head counts, partial rotary."""
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
    if merged.get("rope_type", "default") == "default":
        return theta, None
    return theta, merged


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
