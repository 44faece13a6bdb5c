"""Parameter counts from a model's shapes: (total, active per token), for weight bytes."""
from __future__ import annotations

from kvslim.models.config import ModelConfig
from kvslim.models.families import family_of


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters from the shapes. They differ only for MoE models,
    where every expert must be resident but each token runs `num_experts_per_tok` of them."""
    h, layers = config.hidden_size, config.num_hidden_layers
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    total = active = embeddings + h                         # + the final norm
    norms = family_of(config).norms_per_layer * h
    for layer in range(layers):
        attention = _mla_params(config) if config.mla else _attention_params(config, layer)
        mlp_total, mlp_active = _mlp_params(config, layer)
        total += attention + norms + mlp_total
        active += attention + norms + mlp_active
    return total, active


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _attention_params(config: ModelConfig, layer: int) -> int:
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.kv_heads_of(layer) * d
    qk_norms = 2 * d if config.qk_norm else 0
    return (_linear(h, q, config.qkv_bias) + 2 * _linear(h, kv, config.qkv_bias)
            + _linear(q, h, config.o_bias) + qk_norms)


def _mla_params(config: ModelConfig) -> int:
    """DeepSeek-V2 attention: low-rank Q (with its norm), the joint KV down-projection that
    produces the cached latent + RoPE key, its norm, the KV up-projection and the output."""
    m, h, heads = config.mla, config.hidden_size, config.num_attention_heads
    q_out = heads * config.head_dim
    if m.q_lora_rank:
        q = _linear(h, m.q_lora_rank, config.qkv_bias) + m.q_lora_rank + m.q_lora_rank * q_out
    else:
        q = h * q_out
    kv_down = _linear(h, m.kv_lora_rank + m.qk_rope_head_dim, config.qkv_bias) + m.kv_lora_rank
    kv_up = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv_down + kv_up + _linear(heads * m.v_head_dim, h, config.qkv_bias)


def _swiglu(hidden: int, intermediate: int, bias: bool) -> int:
    return 2 * _linear(hidden, intermediate, bias) + _linear(intermediate, hidden, bias)


def _mlp_params(config: ModelConfig, layer: int) -> tuple[int, int]:
    h, moe = config.hidden_size, config.moe
    is_moe = (moe is not None and layer >= moe.first_dense_layers
              and (layer - moe.first_dense_layers) % moe.layer_freq == 0)
    if not is_moe:
        dense = _swiglu(h, config.intermediate_size, config.mlp_bias)
        return dense, dense
    expert = _swiglu(h, moe.expert_intermediate_size, False)
    shared = _swiglu(h, moe.expert_intermediate_size * moe.num_shared_experts, False) \
        if moe.num_shared_experts else 0
    # the router, and DeepSeek-V3's expert selection bias beside it
    router = h * moe.num_experts + (moe.num_experts if moe.scoring == "sigmoid" else 0)
    return (router + shared + moe.num_experts * expert,
            router + shared + moe.num_experts_per_tok * expert)
