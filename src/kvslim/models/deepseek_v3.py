"""DeepSeek-V3: DeepSeek-V2's decoder (models/deepseek_v2.py) with V3's router: sigmoid scores,
experts chosen on the scores plus `e_score_correction_bias` within the best `topk_group` groups
(noaux_tc), weighted by the unbiased scores (layers/deepseek_moe.py). RoPE on interleaved pairs
unless `rope_interleave` is false. The multi-token-prediction layers its checkpoints may keep
after the decoder's (`num_nextn_predict_layers`) are not run, and are skipped at load as
transformers skips them."""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvslim.errors import ConfigError
from kvslim.models.base import Family
from kvslim.models.deepseek_v2 import (DeepseekForCausalLM, fields_of, mla_from_hf, moe_from_hf,
                                       write_hf)

if TYPE_CHECKING:
    import torch

    from kvslim.models.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    method = cfg.get("topk_method") or "noaux_tc"
    scoring = cfg.get("scoring_func") or "sigmoid"
    if method != "noaux_tc" or scoring != "sigmoid":
        raise ConfigError(f"config.json: DeepSeek-V3 topk_method {method!r} with scoring_func "
                          f"{scoring!r} is not supported (noaux_tc, sigmoid)")
    fields = fields_of(cfg, mla_from_hf(cfg), moe_from_hf(cfg, "sigmoid", method))
    moe = fields["moe"]
    if moe is not None and moe.num_experts // moe.n_group < 2:
        raise ConfigError(f"config.json: n_group {moe.n_group} leaves fewer than two of the "
                          f"{moe.num_experts} experts per group (noaux_tc scores a group by two)")
    return {**fields, "mlp_bias": False}


def _is_extra_layer(name: str) -> bool:
    return _LAYER.match(name) is not None


def _from_checkpoint(name: str, tensor: torch.Tensor, config: ModelConfig
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Layers past num_hidden_layers (the multi-token-prediction modules) are dropped."""
    if int(_LAYER.match(name).group(1)) < config.num_hidden_layers:
        yield name, tensor


def _write_hf(config: ModelConfig, cfg: dict[str, Any]) -> None:
    write_hf(config, cfg)
    cfg.pop("mlp_bias", None)


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepSeek-V3", DeepseekForCausalLM,
                hf_fields=_hf_fields, write_hf=_write_hf, translates=_is_extra_layer,
                from_checkpoint=_from_checkpoint, scale_folding=False,
                quantized_unsupported="latent attention runs float weights only")
