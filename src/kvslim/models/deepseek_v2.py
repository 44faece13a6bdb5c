"""DeepSeek-V2, read for its shapes only: the memory planner sizes its multi-head latent attention
(`MLAConfig`) and its mixture of experts (shared experts, leading dense layers); nothing in
kvslim runs it (`ModelConfig.from_hf_dict(cfg, runnable=False)`)."""
from __future__ import annotations

from typing import Any

from kvslim.models.base import Family
from kvslim.models.shape_only import MLAConfig, MoEConfig


def mla_from_hf(cfg: dict[str, Any]) -> MLAConfig:
    return MLAConfig(kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                     qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                     v_head_dim=int(cfg["v_head_dim"]),
                     q_lora_rank=cfg.get("q_lora_rank"))


def _moe_from_hf(cfg: dict[str, Any]) -> MoEConfig | None:
    if not cfg.get("n_routed_experts"):
        return None
    return MoEConfig(num_experts=int(cfg["n_routed_experts"]),
                     num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                     expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                     num_shared_experts=int(cfg.get("n_shared_experts") or 0),
                     first_dense_layers=int(cfg.get("first_k_dense_replace", 0)),
                     layer_freq=int(cfg.get("moe_layer_freq", 1)))


def _hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """A K head is its no-RoPE part and its RoPE part side by side."""
    mla = mla_from_hf(cfg)
    return {"mla": mla, "head_dim": mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            "moe": _moe_from_hf(cfg)}


FAMILY = Family("deepseek_v2", "DeepseekV2ForCausalLM", "DeepSeek-V2", None, hf_fields=_hf_fields)
