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


def gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields a Gemma 3 config.json sets its own way: local and global layers
    (`layer_types`, or the older `sliding_window_pattern`), each with its RoPE base
    (`rope_parameters` per layer type, or the older `rope_theta` + `rope_local_base_freq`), the
    attention scale's `query_pre_attn_scalar`, tied embeddings by default."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConfigError(f"config.json: {key} is not supported (Gemma 3 sets it to null)")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("config.json: use_bidirectional_attention is not supported")
    n, pattern = int(cfg["num_hidden_layers"]), int(cfg.get("sliding_window_pattern", 6))
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full = dict(params["full_attention"])
        theta = float(full.pop("rope_theta", 1_000_000.0))
        local = float((params.get("sliding_attention") or {}).get("rope_theta", 10_000.0))
        scaling = full if full.get("rope_type", "default") != "default" else None
    else:
        theta, scaling = rope_from_hf({**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)})
        local = float(cfg.get("rope_local_base_freq", 10_000.0))
    head_dim = int(cfg.get("head_dim") or 256)
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local,
                layer_types=tuple(types), sliding_window=cfg.get("sliding_window"),
                query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", head_dim),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), qk_norm=True)


def gemma3_hf_fields(config) -> dict[str, Any]:
    """The same fields written back the way transformers' Gemma3TextConfig reads them."""
    full = {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})}
    return {"hidden_activation": config.hidden_act, "layer_types": list(config.layer_types),
            "sliding_window": config.sliding_window,
            "query_pre_attn_scalar": config.query_pre_attn_scalar,
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": config.rope_local_theta}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None}


def moe_hf_fields(config, cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts config's expert fields as transformers' Mixtral and Qwen3-MoE configs
    read them: written out, since an imported GGUF file has no config.json to keep them from.
    `cfg` loses the alias of the count that is not written (transformers 5 saves Qwen3-MoE's
    `num_experts` as `num_local_experts`)."""
    moe = config.moe
    if config.model_type == "mixtral":
        return {"num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.num_experts_per_tok}
    cfg.pop("num_local_experts", None)
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
            "moe_intermediate_size": moe.expert_intermediate_size,
            "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": []}
