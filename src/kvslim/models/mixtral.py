"""Mixtral: the Llama decoder with a sparse mixture-of-experts MLP (layers/moe.py) in every
layer. Its checkpoints name the block `block_sparse_moe`, the router `gate` and each expert's
projections w1 (gate), w3 (up) and w2 (down); inside kvslim they go by the Llama family's names
(`mlp.gate`, `mlp.experts.E.gate_proj` / `up_proj` / `down_proj`), so the packed gate/up rule,
the writer and the rest work unchanged. This rule renames at the checkpoint boundary.
llama.cpp stores Mixtral as a `llama` file with experts (formats/gguf/moe.py)."""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from kvslim.models import llama
from kvslim.models.base import MOE_LAYER_TENSORS, Family, write_attention_bias
from kvslim.models.shape_only import MoEConfig

if TYPE_CHECKING:
    from kvslim.models.config import ModelConfig

_TO_KVSLIM = [(re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
              (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
              (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
              (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate.")]
_TO_CHECKPOINT = [(re.compile(r"\.mlp\.experts\.(\d+)\.gate_proj\."), r".block_sparse_moe.experts.\1.w1."),
                  (re.compile(r"\.mlp\.experts\.(\d+)\.up_proj\."), r".block_sparse_moe.experts.\1.w3."),
                  (re.compile(r"\.mlp\.experts\.(\d+)\.down_proj\."), r".block_sparse_moe.experts.\1.w2."),
                  (re.compile(r"\.mlp\.gate\."), ".block_sparse_moe.gate.")]


def is_checkpoint_name(name: str) -> bool:
    return ".block_sparse_moe." in name


def _rename(name: str, rules) -> str:
    for pattern, replacement in rules:
        name, n = pattern.subn(replacement, name)
        if n:
            break
    return name


def from_checkpoint(name: str, tensor: torch.Tensor, config: ModelConfig
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    yield _rename(name, _TO_KVSLIM), tensor


def to_checkpoint(state: dict[str, torch.Tensor], config: ModelConfig
                  ) -> dict[str, torch.Tensor]:
    return {_rename(name, _TO_CHECKPOINT): tensor for name, tensor in state.items()}


def _hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every layer's MLP is the experts; they renormalise the chosen ones' weights."""
    return {"moe": MoEConfig(num_experts=int(cfg["num_local_experts"]),
                             num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                             expert_intermediate_size=int(cfg["intermediate_size"]))}


def _write_hf(config: ModelConfig, cfg: dict[str, Any]) -> None:
    """The expert fields written out, since an imported GGUF file has no config.json to keep
    them from."""
    write_attention_bias(config, cfg)
    cfg.update(num_local_experts=config.moe.num_experts,
               num_experts_per_tok=config.moe.num_experts_per_tok)


FAMILY = Family("mixtral", "MixtralForCausalLM", "Mixtral", llama.LlamaForCausalLM,
                hf_fields=_hf_fields, write_hf=_write_hf, translates=is_checkpoint_name,
                from_checkpoint=from_checkpoint, to_checkpoint=to_checkpoint,
                gguf=replace(llama.GGUF, layer_tensors={**llama.LLAMA_LAYER_TENSORS,
                                                        **MOE_LAYER_TENSORS}, experts=True))
