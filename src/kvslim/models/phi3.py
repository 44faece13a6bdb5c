"""Phi-3: the Llama decoder (models/llama.py) under another weight-name rule. Its checkpoints
store q, k and v as one `qkv_proj` matrix (q rows, then k, then v) and gate and up as one
`gate_up_proj` (gate rows, then up). Everything inside kvslim — surgery, quantization, the
writer's callers — speaks the split, Llama-style names, so this rule splits fused tensors when a
checkpoint is read and fuses them again when one is written. Its GGUF files keep the fused
tensors, and its window in `phi3.attention.sliding_window`. LongRoPE (Phi-3's long-context
scaling) is layers/rope.py's."""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from kvslim.errors import KvslimError
from kvslim.models.base import Family, GGUFLayout
from kvslim.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from kvslim.models.config import ModelConfig

# checkpoint module -> the split modules it stacks, in row order
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _layer_and_module(name: str) -> tuple[str, str, str] | None:
    """"model.layers.3.mlp.gate_up_proj.weight" -> ("model.layers.3.", "mlp.gate_up_proj",
    "weight") for a fused module's tensor, else None."""
    for fused in FUSED:
        marker = f".{fused}."
        if marker in name:
            prefix, leaf = name.split(marker)
            return prefix + ".", fused, leaf
    return None


def is_fused_name(name: str) -> bool:
    return _layer_and_module(name) is not None


def _row_sizes(config: ModelConfig, layer: int, fused: str) -> list[int]:
    if fused == "mlp.gate_up_proj":
        return [config.intermediate_size] * 2
    kv = config.kv_heads_of(layer) * config.head_dim
    return [config.num_attention_heads * config.head_dim, kv, kv]


def split_tensor(name: str, tensor: torch.Tensor, config: ModelConfig
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint tensor under the split names: a fused weight or bias as its row blocks."""
    found = _layer_and_module(name)
    if found is None:
        yield name, tensor
        return
    prefix, fused, leaf = found
    if leaf not in ("weight", "bias"):
        raise KvslimError(f"{name}: quantized Phi-3 checkpoints are not supported yet")
    layer = int(prefix.split(".")[-2])
    sizes = _row_sizes(config, layer, fused)
    if tensor.shape[0] != sum(sizes):
        raise KvslimError(f"{name} has {tensor.shape[0]} rows, expected {sum(sizes)} from "
                          "config.json")
    for part, rows in zip(FUSED[fused], tensor.split(sizes)):
        yield f"{prefix}{part}.{leaf}", rows


def fuse_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The split names' state dict as a Phi-3 checkpoint, fused modules in their place."""
    out: dict[str, torch.Tensor] = {}
    parts = {part: fused for fused, split in FUSED.items() for part in split}
    for name, tensor in state.items():
        prefix, _, rest = name.partition(".layers.")
        layer, _, module_leaf = rest.partition(".")
        module, _, leaf = module_leaf.rpartition(".")
        if module not in parts:
            out[name] = tensor
            continue
        if leaf not in ("weight", "bias"):
            raise KvslimError("quantized Phi-3 checkpoints are not supported yet: "
                              f"{name} has no fused form")
        fused = parts[module]
        key = f"{prefix}.layers.{layer}.{fused}.{leaf}"
        if key in out:
            continue
        out[key] = torch.cat([state[f"{prefix}.layers.{layer}.{p}.{leaf}"]
                              for p in FUSED[fused]])
    return out


# The fused tensors as the file keeps them (split at the checkpoint boundary, as above)
LAYER_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                 "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj",
                 "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
FAMILY = Family("phi3", "Phi3ForCausalLM", "Phi-3", LlamaForCausalLM,
                translates=is_fused_name, from_checkpoint=split_tensor, to_checkpoint=fuse_state,
                gguf=GGUFLayout("phi3", LAYER_TENSORS, sliding_window=True, float_only=True),
                quantized_unsupported="their fused projections have no quantized reader")
