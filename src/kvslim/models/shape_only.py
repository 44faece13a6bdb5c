"""The parts of a model beyond a dense decoder's: mixture-of-experts MLPs (Mixtral, Qwen3-MoE,
DeepSeek) and DeepSeek's latent attention (layers/latent_attention.py, its latent cache
attention/latent_cache.py). Each family's file reads them from its config.json."""
from __future__ import annotations

from dataclasses import dataclass


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
    # DeepSeek's routers (layers/deepseek_moe.py): "softmax" (V2) or "sigmoid" (V3, with its
    # selection bias), V2's "greedy" or "group_limited_greedy", the groups experts are chosen
    # within, and the factor on the chosen experts' weights
    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention. Its cache is not K/V heads: one compressed
    latent of `kv_lora_rank` plus one shared RoPE key of `qk_rope_head_dim` per token and layer,
    one row of `cache_width` (what the engine stores, attention/latent_cache.py, and the
    planner prices)."""
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    rope_interleave: bool = True           # RoPE on interleaved pairs (V3 may rotate halves)

    @property
    def cache_width(self) -> int:
        """One cached row: the latent c_kv, then the RoPE'd shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_elements_per_token(self, num_layers: int) -> int:
        """The latent layout, whatever the head count."""
        return num_layers * self.cache_width
