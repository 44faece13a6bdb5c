"""Mixtral: the Llama decoder with a sparse mixture-of-experts MLP (layers/moe.py) in every
layer. Its checkpoints name the block `block_sparse_moe`, the router `gate` and each expert's
projections w1 (gate), w3 (up) and w2 (down); inside kvslim they go by the Llama family's names
(`mlp.gate`, `mlp.experts.E.gate_proj` / `up_proj` / `down_proj`), so the packed gate/up rule,
the writer and the rest work unchanged. This rule renames at the checkpoint boundary."""
from __future__ import annotations

import re

import torch

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


def to_kvslim_name(name: str) -> str:
    return _rename(name, _TO_KVSLIM)


def to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_rename(name, _TO_CHECKPOINT): tensor for name, tensor in state.items()}
