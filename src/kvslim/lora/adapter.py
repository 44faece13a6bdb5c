"""`load_adapter`: a peft LoRA directory (`adapter_config.json` + `adapter_model.safetensors`)
read into what kvslim's layers add: for each wrapped linear (`layers/...qkv_proj`, `o_proj`,
`gate_up_proj`, `down_proj`), the A and B matrices of the shards the adapter trains, with the
scaling folded into B (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; per module under
peft's rank_pattern / alpha_pattern).

A module named as the checkpoint names it (q_proj, gate_proj) lands on its shard of kvslim's
fused layer (CausalLM.packed_modules_mapping); one named as kvslim's fused layer itself (Phi-3's
qkv_proj) trains all of its shards. What kvslim does not run is refused with one line that
names it: DoRA, trained biases, embedding or LM-head adapters, modules_to_save, a rank above
max_lora_rank, a module the model has no wrapped linear for."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvslim.errors import InvalidRequestError
from kvslim.lora.request import LoRARequest

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class ModuleLoRA:
    """One wrapped linear's share of an adapter: shard key (None: the whole layer) -> (A [r,
    in], B [rows, r] scaled)."""
    shards: dict[object, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int                                            # the largest rank of its modules
    modules: dict[str, ModuleLoRA]                       # kvslim module name -> its LoRA

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.modules.values()
                   for pair in m.shards.values() for t in pair)


def _refuse(request: LoRARequest, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {why}",
                               "lora_request")


def read_config(request: LoRARequest) -> dict:
    path = Path(request.lora_path) / CONFIG_FILE
    if not path.is_file():
        raise _refuse(request, f"no {CONFIG_FILE} (a peft LoRA adapter directory is expected)")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(request, f"peft_type {config['peft_type']} is not LoRA")
    for key, why in (("use_dora", "DoRA adapters are not supported"),
                     ("modules_to_save", "modules_to_save (fully trained modules) are not "
                                         "supported"),
                     ("layers_pattern", "layers_pattern is not supported")):
        if config.get(key):
            raise _refuse(request, why)
    if config.get("bias", "none") != "none":
        raise _refuse(request, f"trained biases (bias={config['bias']!r}) are not supported")
    return config


def load_adapter(request: LoRARequest, model, targets: dict[str, object], max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """`targets`: kvslim module name -> the linear it wraps (its shard_sizes / shard_key)."""
    from safetensors.torch import load_file
    config = read_config(request)
    weights_path = Path(request.lora_path) / WEIGHTS_FILE
    if not weights_path.is_file():
        raise _refuse(request, f"no {WEIGHTS_FILE}")
    tensors = load_file(str(weights_path))
    pairs, others = _pairs(request, tensors)
    modules: dict[str, ModuleLoRA] = {}
    rank = 0
    for hf_name, (a, b) in pairs.items():
        r = a.shape[0]
        if r > max_rank:
            raise _refuse(request, f"rank {r} of {hf_name} is above max_lora_rank ({max_rank})")
        rank = max(rank, r)
        target, shard = _target(request, model, hf_name, targets)
        layer = targets[target]
        if a.shape[1] != layer.in_features or b.shape != (_rows(layer, shard), r):
            raise _refuse(request, f"{hf_name} has shapes A {tuple(a.shape)}, B "
                                   f"{tuple(b.shape)}, which do not fit the model's layer")
        scaled = b.to(torch.float32) * _scaling(config, hf_name, r)
        modules.setdefault(target, ModuleLoRA()).shards[shard] = (a.to(dtype), scaled.to(dtype))
    if others:
        raise _refuse(request, f"{others[0]}: whole weights in an adapter (modules_to_save, a "
                               f"tied layer) are not supported")
    if not modules:
        raise _refuse(request, "it holds no LoRA weights")
    return LoRAAdapter(request, rank, modules)


def _pairs(request: LoRARequest, tensors: dict[str, torch.Tensor]
           ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """HF module name -> (lora_A weight, lora_B weight); and the other tensors' names."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for key, tensor in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_[AB]|lora_embedding_[AB]|"
                         r"lora_magnitude_vector)(?:\.[A-Za-z0-9_-]+)?(?:\.weight)?", key)
        if m is None:
            others.append(key)
            continue
        if m.group(2) == "lora_magnitude_vector":
            raise _refuse(request, "DoRA adapters are not supported")
        if m.group(2).startswith("lora_embedding"):
            raise _refuse(request, f"embedding adapters ({m.group(1)}) are not supported")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    out = {}
    for name, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise _refuse(request, f"{name} lacks its {'lora_B' if 'lora_A' in pair else 'lora_A'}")
        out[name] = (pair["lora_A"], pair["lora_B"])
    return out, others


def _target(request: LoRARequest, model, hf_name: str, targets: dict) -> tuple[str, object]:
    """The wrapped kvslim linear an HF module name lands on, and its shard key."""
    parent, _, leaf = hf_name.rpartition(".")
    if leaf in model.packed_modules_mapping:
        part, shard = model.packed_modules_mapping[leaf]
        name = f"{parent}.{part}"
        if name in targets:
            return name, targets[name].shard_key(shard)
    elif hf_name in targets:
        return hf_name, None
    supported = sorted({n.rpartition(".")[2] for n in targets} - {"qkv_proj", "gate_up_proj"}
                       | {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
    raise _refuse(request, f"module {hf_name} is not one kvslim runs adapters on (supported: "
                           f"{', '.join(supported)} of the decoder layers)")


def _rows(layer, shard) -> int:
    return layer.out_features if shard is None else layer.shard_sizes[shard]


def _scaling(config: dict, hf_name: str, r: int) -> float:
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", hf_name):
            alpha = value
            break
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
