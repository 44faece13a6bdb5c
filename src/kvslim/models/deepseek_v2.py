"""DeepSeek-V2 (and the decoder DeepSeek-V3 shares, models/deepseek_v3.py): multi-head latent
attention (layers/latent_attention.py; the engine caches its latent, attention/latent_cache.py)
and DeepSeek's mixture of experts (layers/deepseek_moe.py: routed experts with a softmax
router, shared experts, `first_k_dense_replace` leading dense layers), the Llama decoder's norms
and residuals around them, RoPE over each head's `qk_rope_head_dim` part only.

Checkpoints use transformers' names: `q_proj` (or `q_a_proj`, `q_a_layernorm`, `q_b_proj`),
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`; `mlp.gate` (the router),
`mlp.experts.E.{gate,up,down}_proj`, `mlp.shared_experts.*`. Only gate/up are fused inside
kvslim, so nothing is renamed at the boundary. The memory planner reads the same config for its
shapes (`MLAConfig`: it prices the latent cache a DeepSeek engine keeps, `kvslim memory`)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torch import nn

from kvslim.errors import ConfigError
from kvslim.layers.mlp import SwiGLUMLP
from kvslim.layers.norm import RMSNorm
from kvslim.layers.rope import RotaryEmbedding
from kvslim.models.base import Family
from kvslim.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel, make_lm_head
from kvslim.models.shape_only import MLAConfig, MoEConfig

if TYPE_CHECKING:
    from kvslim.models.config import ModelConfig


class DeepseekDecoderLayer(DecoderLayer):
    """Llama's layer (its forward) with latent attention and a dense or expert MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        # DeepSeek's own layers load with its first model, not with the family table.
        from kvslim.layers.deepseek_moe import DeepseekMoE, layer_is_sparse
        from kvslim.layers.latent_attention import LatentAttention
        nn.Module.__init__(self)
        h, quant = config.hidden_size, config.quantization
        self.self_attn = LatentAttention(h, config.num_attention_heads, config.mla, layer_idx,
                                         attention_scale(config), config.qkv_bias, quant)
        self.mlp = (DeepseekMoE(h, config.moe, config.hidden_act, config.mlp_bias, quant)
                    if layer_is_sparse(config.moe, layer_idx) else
                    SwiGLUMLP(h, config.intermediate_size, config.mlp_bias, quant,
                              activation=config.hidden_act))
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)


class DeepseekModel(LlamaModel):
    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.mla.qk_rope_head_dim, config.rope_theta,
                                      config.rope_scaling)


class DeepseekForCausalLM(LlamaForCausalLM):
    # q_proj is a projection of its own here (no k_proj/v_proj to fuse it with)
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.config = config
        self.model = DeepseekModel(config)
        self.lm_head = make_lm_head(config, self.model.embed_tokens)

    def prepare_for_inference(self) -> bool:
        """Each latent attention's absorbed matrices first (out of kv_b_proj's weight, which
        the linear kernels may then hold in their own form), then the kernels."""
        for layer in self.model.layers:
            layer.self_attn.absorb()
        return super().prepare_for_inference()


def attention_scale(config: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when the RoPE
    scaling has an `mscale_all_dim` (transformers' `yarn_apply_mscale`)."""
    scale = config.head_dim ** -0.5
    scaling = config.rope_scaling or {}
    factor, mscale_all_dim = scaling.get("factor"), scaling.get("mscale_all_dim")
    if mscale_all_dim and factor is not None and float(factor) > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(float(factor)) + 1.0
        scale *= mscale * mscale
    return scale


# ---- config.json ---------------------------------------------------------------------------
def mla_from_hf(cfg: dict[str, Any]) -> MLAConfig:
    q_lora_rank = cfg.get("q_lora_rank")
    return MLAConfig(kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                     qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                     v_head_dim=int(cfg["v_head_dim"]),
                     q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
                     rope_interleave=bool(cfg.get("rope_interleave", True)))


def moe_from_hf(cfg: dict[str, Any], scoring: str, topk_method: str) -> MoEConfig | None:
    if not cfg.get("n_routed_experts"):
        return None
    return MoEConfig(num_experts=int(cfg["n_routed_experts"]),
                     num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                     expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                     num_shared_experts=int(cfg.get("n_shared_experts") or 0),
                     first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
                     layer_freq=int(cfg.get("moe_layer_freq") or 1),
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     scoring=scoring, topk_method=topk_method,
                     n_group=int(cfg.get("n_group") or 1),
                     topk_group=int(cfg.get("topk_group") or 1),
                     routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))


def check_supported(mla: MLAConfig, moe: MoEConfig | None, heads: int, kv_heads: Any) -> None:
    """What transformers 5.23 runs and kvslim does not (or runs differently), refused by name."""
    if mla.v_head_dim > mla.qk_nope_head_dim + mla.qk_rope_head_dim:
        raise ConfigError(f"config.json: v_head_dim {mla.v_head_dim} wider than a key head "
                          f"({mla.qk_nope_head_dim} + {mla.qk_rope_head_dim}) is not supported")
    if kv_heads is not None and int(kv_heads) != heads:
        raise ConfigError(f"config.json: num_key_value_heads {kv_heads} != num_attention_heads "
                          f"{heads} is not supported with latent attention")
    if moe is None:
        return
    if moe.layer_freq != 1:
        raise ConfigError(f"config.json: moe_layer_freq {moe.layer_freq} is not supported "
                          "(transformers runs experts in every layer after the dense ones: 1)")
    grouped = moe.scoring == "sigmoid" or moe.topk_method == "group_limited_greedy"
    if grouped and (moe.num_experts % moe.n_group or not 0 < moe.topk_group <= moe.n_group):
        raise ConfigError(f"config.json: {moe.num_experts} experts in n_group {moe.n_group} "
                          f"with topk_group {moe.topk_group} do not make whole groups")


def _hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """A K head is its no-RoPE part and its RoPE part side by side; K/V heads = query heads."""
    method = cfg.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"config.json: DeepSeek-V2 topk_method {method!r} is not supported "
                          "(greedy, group_limited_greedy)")
    if (cfg.get("scoring_func") or "softmax") != "softmax":
        raise ConfigError(f"config.json: DeepSeek-V2 scoring_func {cfg['scoring_func']!r} is not "
                          "supported (softmax)")
    return fields_of(cfg, mla_from_hf({**cfg, "rope_interleave": True}),
                     moe_from_hf(cfg, "softmax", method))


def fields_of(cfg: dict[str, Any], mla: MLAConfig, moe: MoEConfig | None) -> dict[str, Any]:
    heads = int(cfg["num_attention_heads"])
    check_supported(mla, moe, heads, cfg.get("num_key_value_heads"))
    return {"mla": mla, "head_dim": mla.qk_nope_head_dim + mla.qk_rope_head_dim, "moe": moe,
            "num_key_value_heads": heads}


def write_hf(config: ModelConfig, cfg: dict[str, Any]) -> None:
    cfg["attention_bias"] = config.qkv_bias
    cfg["mlp_bias"] = config.mlp_bias
    cfg.pop("head_dim", None)                  # transformers' is the RoPE part's width


FAMILY = Family("deepseek_v2", "DeepseekV2ForCausalLM", "DeepSeek-V2", DeepseekForCausalLM,
                hf_fields=_hf_fields, write_hf=write_hf, scale_folding=False,
                quantized_unsupported="latent attention runs float weights only")
