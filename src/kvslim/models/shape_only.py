"""The parts of a config.json that only the memory planner reads: mixture-of-experts MLPs and
DeepSeek's latent attention (architectures kvslim sizes but does not run)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Mixtral, DeepSeek): every expert is resident, a few run per token."""
    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    first_dense_layers: int = 0        # leading layers that keep a dense MLP (DeepSeek)
    layer_freq: int = 1                # every layer_freq-th layer after those is MoE


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention. Its cache is not K/V heads: one compressed latent
    of `kv_lora_rank` plus one shared RoPE key of `qk_rope_head_dim` per token and layer."""
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None

    def cache_elements_per_token(self, num_layers: int) -> int:
        """The latent layout, whatever the head count."""
        return num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)


def moe_from_hf(cfg: dict[str, Any], arch: str) -> MoEConfig | None:
    if arch == "MixtralForCausalLM":
        return MoEConfig(num_experts=int(cfg["num_local_experts"]),
                         num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                         expert_intermediate_size=int(cfg["intermediate_size"]))
    if arch == "DeepseekV2ForCausalLM" and cfg.get("n_routed_experts"):
        return MoEConfig(num_experts=int(cfg["n_routed_experts"]),
                         num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                         expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                         num_shared_experts=int(cfg.get("n_shared_experts") or 0),
                         first_dense_layers=int(cfg.get("first_k_dense_replace", 0)),
                         layer_freq=int(cfg.get("moe_layer_freq", 1)))
    return None


def mla_from_hf(cfg: dict[str, Any]) -> MLAConfig:
    return MLAConfig(kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                     qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                     v_head_dim=int(cfg["v_head_dim"]),
                     q_lora_rank=cfg.get("q_lora_rank"))
