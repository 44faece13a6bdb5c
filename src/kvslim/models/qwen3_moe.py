"""Qwen3-MoE: Qwen3's decoder (models/qwen3.py) with a sparse mixture-of-experts MLP
(layers/moe.py) in every layer, the chosen experts' weights renormalised only under
`norm_topk_prob` (transformers' default: not). Its checkpoints already use the Llama family's
expert names. llama.cpp's `qwen3moe` files keep the experts' width in its own key and always
renormalise (formats/gguf/moe.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvslim.errors import ConfigError
from kvslim.models import qwen3
from kvslim.models.base import MOE_LAYER_TENSORS, Family, GGUFLayout, write_attention_bias
from kvslim.models.llama import LlamaForCausalLM
from kvslim.models.shape_only import MoEConfig

if TYPE_CHECKING:
    from kvslim.models.config import ModelConfig


def _hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    _check_every_layer_sparse(cfg)
    moe = MoEConfig(num_experts=int(_num_experts(cfg)),
                    num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return {**qwen3.hf_fields(cfg), "moe": moe}


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


def _write_hf(config: ModelConfig, cfg: dict[str, Any]) -> None:
    """The expert fields as transformers' Qwen3-MoE config reads them, written out since an
    imported GGUF file has no config.json to keep them from. `cfg` loses the alias of the count
    (transformers 5 saves `num_experts` as `num_local_experts`)."""
    write_attention_bias(config, cfg)
    moe = config.moe
    cfg.pop("num_local_experts", None)
    cfg.update(num_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
               moe_intermediate_size=moe.expert_intermediate_size,
               norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", LlamaForCausalLM,
                hf_fields=_hf_fields, write_hf=_write_hf,
                gguf=GGUFLayout("qwen3moe", {**qwen3.LAYER_TENSORS, **MOE_LAYER_TENSORS},
                                experts=True, expert_width_key=True, fields=qwen3.gguf_fields))
