"""Sparse mixture-of-experts models in GGUF files, as llama.cpp's converter writes them.

- Mixtral is the `llama` architecture plus `llama.expert_count` and `llama.expert_used_count`;
  Qwen3-MoE is `qwen3moe` (Qwen3's attention), its experts' width in
  `qwen3moe.expert_feed_forward_length` (`feed_forward_length` is the dense width, unused when
  every layer has experts).
- Per layer the router is `ffn_gate_inp` [experts, hidden], which llama.cpp always keeps in F32
  (a rounded router can choose other experts). Each of the experts' three projections is one
  3-D tensor over all experts: the converter stacks the HF [out, in] matrices along a new first dimension
  (`torch.stack(dim=0)`), so in PyTorch's order `ffn_gate_exps` and `ffn_up_exps` are
  [experts, ffn, hidden] and `ffn_down_exps` is [experts, hidden, ffn] (GGUF lists the
  dimensions the other way round). The layer tables (models/base.py) name them after kvslim's
  stacked `mlp.experts.gate_proj` etc.; `split_experts` and `stack_experts` go between those and
  one tensor per expert. Files converted before llama.cpp stacked them (early 2024 Mixtral
  ones) hold one 2-D tensor per expert instead, `blk.N.ffn_gate.E.weight`: `legacy_expert_name`.
- llama.cpp renormalises the chosen experts' weights in both (Mixtral's rule; for `qwen3moe` it
  is fixed, whatever `norm_topk_prob` was), so the importer sets it and the exporter refuses a
  Qwen3-MoE model without it rather than write a file llama.cpp would run differently."""
from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from kvslim.errors import ConfigError
from kvslim.formats.gguf.archs import gguf_family
from kvslim.formats.gguf.file import GGUFFile
from kvslim.models.config import ModelConfig
from kvslim.models.families import family_of
from kvslim.models.shape_only import MoEConfig

ROUTER = "ffn_gate_inp"
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight")
_ONE_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight")
_LEGACY_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


def moe_config_fields(gguf: GGUFFile, arch: str) -> dict:
    """ModelConfig fields of a file with experts (the family's architecture, `moe`); {} without
    them. An architecture that is experts only (`qwen3moe`) must say how many."""
    moe_family = gguf_family(arch, experts=True)
    if moe_family is None:
        return {}
    count = gguf.get(f"{arch}.expert_count")
    has_router = any(f".{ROUTER}." in name for name in gguf.tensor_names)
    if count is None and (gguf_family(arch, experts=False) is None or has_router):
        raise ConfigError(f"{gguf.path.name}: GGUF metadata has no '{arch}.expert_count'")
    if count is None:
        return {}
    dense = int(gguf.require(f"{arch}.feed_forward_length"))
    width = int(gguf.get(f"{arch}.expert_feed_forward_length", dense))
    moe = MoEConfig(num_experts=int(count),
                    num_experts_per_tok=int(gguf.require(f"{arch}.expert_used_count")),
                    expert_intermediate_size=width, norm_topk_prob=True)
    return {"architecture": moe_family.architecture, "moe": moe}


def legacy_expert_name(gguf_name: str) -> str | None:
    """kvslim's name of one expert's tensor in the unstacked layout, or None."""
    m = _LEGACY_EXPERT.fullmatch(gguf_name)
    if m is None:
        return None
    layer, projection, expert = m.groups()
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}_proj.weight"


def split_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor as one tensor per expert under kvslim's names; any other as is."""
    m = _STACKED.fullmatch(name)
    if m is None or tensor.dim() != 3:
        yield name, tensor
        return
    prefix, projection = m.groups()
    for e, weight in enumerate(tensor.unbind(0)):
        yield f"{prefix}.{e}.{projection}.weight", weight.contiguous()


def stack_experts(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse: each layer's experts' projections as one [experts, out, in] tensor, in the
    place of its first expert's."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = _ONE_EXPERT.fullmatch(name)
        if m is None:
            out[name] = tensor
            continue
        prefix, _, projection = m.groups()
        stacked = f"{prefix}.{projection}.weight"
        if stacked not in out:
            out[stacked] = torch.stack([state[f"{prefix}.{e}.{projection}.weight"]
                                        for e in range(config.moe.num_experts)])
    return out


def check_exportable(config: ModelConfig) -> None:
    """llama.cpp renormalises the chosen experts' weights in every MoE architecture kvslim
    writes (Mixtral's always are; Qwen3-MoE's only under norm_topk_prob)."""
    if not config.moe.norm_topk_prob:
        family = family_of(config)
        raise ConfigError(f"this {family.name} model does not renormalise its top-k router "
                          f"weights (norm_topk_prob false), which llama.cpp's {family.gguf.arch} "
                          "always does: it cannot be exported as itself")


def add_moe_metadata(writer, config: ModelConfig) -> None:
    """The expert keys llama.cpp reads (the `feed_forward_length` written beside them is
    Mixtral's expert width, Qwen3-MoE's dense one)."""
    writer.add_expert_count(config.moe.num_experts)
    writer.add_expert_used_count(config.moe.num_experts_per_tok)
    if family_of(config).gguf.expert_width_key:
        writer.add_expert_feed_forward_length(config.moe.expert_intermediate_size)


def is_router(gguf_name: str) -> bool:
    return gguf_name.endswith(f".{ROUTER}.weight")
