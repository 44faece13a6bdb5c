"""The parts of a config.json beyond a dense decoder's: mixture-of-experts MLPs (run for Mixtral
and Qwen3-MoE, sized only for DeepSeek) and DeepSeek's latent attention (sized, not run)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvslim.errors import ConfigError


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Mixtral, Qwen3-MoE, DeepSeek): every expert is resident, a few
    run per token."""
    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    first_dense_layers: int = 0        # leading layers that keep a dense MLP (DeepSeek)
    layer_freq: int = 1                # every layer_freq-th layer after those is MoE
    # The chosen experts' router probabilities rescaled to sum to 1 (Mixtral always does;
    # Qwen3-MoE by its `norm_topk_prob` flag, which transformers defaults to false).
    norm_topk_prob: bool = True


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
    if arch == "Qwen3MoeForCausalLM":
        _check_every_layer_sparse(cfg)
        return MoEConfig(num_experts=int(_num_experts(cfg)),
                         num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                         expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                         norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if arch == "DeepseekV2ForCausalLM" and cfg.get("n_routed_experts"):
        return MoEConfig(num_experts=int(cfg["n_routed_experts"]),
                         num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                         expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                         num_shared_experts=int(cfg.get("n_shared_experts") or 0),
                         first_dense_layers=int(cfg.get("first_k_dense_replace", 0)),
                         layer_freq=int(cfg.get("moe_layer_freq", 1)))
    return None


def _num_experts(cfg: dict[str, Any]) -> Any:
    """Qwen3-MoE's count: `num_experts` in released configs, `num_local_experts` (its
    attribute_map alias) in those transformers 5 writes."""
    for key in ("num_experts", "num_local_experts"):
        if cfg.get(key) is not None:
            return cfg[key]
    raise KeyError("num_experts")


def _check_every_layer_sparse(cfg: dict[str, Any]) -> None:
    """kvslim builds the MoE block in every layer. Qwen3-MoE's config can keep some layers dense
    (`decoder_sparse_step` > 1, `mlp_only_layers`); no released model does, so it is refused."""
    step, dense = cfg.get("decoder_sparse_step") or 1, cfg.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ConfigError(f"config.json: decoder_sparse_step {step} and mlp_only_layers {dense} "
                          "make some layers dense; kvslim runs Qwen3-MoE with experts in every "
                          "layer (decoder_sparse_step 1, mlp_only_layers [])")


def mla_from_hf(cfg: dict[str, Any]) -> MLAConfig:
    return MLAConfig(kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                     qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                     v_head_dim=int(cfg["v_head_dim"]),
                     q_lora_rank=cfg.get("q_lora_rank"))
