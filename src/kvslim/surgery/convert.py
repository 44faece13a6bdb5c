"""MHA -> GQA/MQA conversion (`kvslim convert`).

For a model with K0 KV heads and a target of K (K0 divisible by K), KV group g takes the source
KV heads [g*K0/K, (g+1)*K0/K); for an MHA source (K0 = H) those are exactly the query heads
[g*H/K, (g+1)*H/K), as in Ainslie et al. (2023). The group's k_proj / v_proj rows (and biases)
are pooled into one head; everything else is copied. Methods:

- mean:   average of the group's heads (the GQA paper's choice)
- first:  the first head of each group
- random: freshly initialised K/V heads (the paper's worst baseline)
- align:  calibrated; see `align.py` — heads are regrouped by similarity and rotated into a common
          basis (rotations the attention output does not see) before they are averaged."""
from __future__ import annotations

from pathlib import Path

import torch

from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig
from kvslim.formats.loader import load_model
from kvslim.formats.writer import save_model
from kvslim.surgery.pooling import POOLING_METHODS, pool_heads

METHODS = POOLING_METHODS + ("align",)


def check_target(config: ModelConfig, kv_heads: int, layer: int | None = None) -> None:
    """`kv_heads` for every layer (layer None), or for one layer of a per-layer target."""
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise KvslimError(f"--kv-heads must be a positive integer, got {kv_heads}")
    where = "" if layer is None else f" in layer {layer}"
    for i, k0 in enumerate(config.kv_heads_per_layer):
        if layer is not None and i != layer:
            continue
        if kv_heads > k0:
            raise KvslimError(f"--kv-heads {kv_heads}{where} is more than the model's "
                              f"{k0} KV heads; conversion only pools heads")
        if k0 % kv_heads != 0:
            raise KvslimError(f"--kv-heads {kv_heads}{where} does not divide the model's {k0} "
                              f"KV heads (num_attention_heads={config.num_attention_heads})")


def check_method(config: ModelConfig, method: str) -> None:
    if method == "align" and config.qk_norm:
        # align rotates keys and queries per RoPE frequency pair before they are normalised; a
        # per-channel RMSNorm weight does not commute with those rotations
        raise KvslimError(f"--method align does not convert {config.architecture} (its q/k "
                          f"norms do not commute with align's rotations); use --method mean")


def layer_targets(config: ModelConfig, kv_heads) -> list[int]:
    """One KV head count per layer: `kv_heads` everywhere, or a per-layer sequence."""
    if isinstance(kv_heads, int) or not hasattr(kv_heads, "__len__"):
        check_target(config, kv_heads)
        return [kv_heads] * config.num_hidden_layers
    targets = list(kv_heads)
    if len(targets) != config.num_hidden_layers:
        raise KvslimError(f"{len(targets)} per-layer KV head counts for "
                          f"{config.num_hidden_layers} layers")
    for i, k in enumerate(targets):
        check_target(config, k, i)
    return targets


def convert_state_dict(state: dict[str, torch.Tensor], config: ModelConfig, kv_heads,
                       method: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Pool every layer's k_proj / v_proj rows (and biases) by `method` (mean, first, random)
    into `kv_heads` (one count, or one per layer)."""
    targets = layer_targets(config, kv_heads)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            out[name] = pool_heads(tensor, config.kv_heads_of(layer), targets[layer], method,
                                   gen)
        else:
            out[name] = tensor.clone()
    return out


def convert_to_gqa(src: str | Path, dst: str | Path, kv_heads, method: str = "mean",
                   calib: str | Path | None = None, calib_samples: int = 32,
                   calib_seq_len: int = 256, seed: int = 0, show_progress: bool = True,
                   model=None, extra_files: dict[str, str] | None = None) -> Path:
    """Write `dst`: the model at `src` with `kv_heads` KV heads (one count, or one per layer),
    loadable by kvslim and, when every layer has the same count, by HF. `model` is `src`
    already loaded in float32, if the caller has it."""
    if method not in METHODS:
        raise KvslimError(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
    model = model or load_model(src, dtype=torch.float32)
    config = model.config
    kv_heads = layer_targets(config, kv_heads)
    check_method(config, method)
    if method == "align":
        if calib is None:
            raise KvslimError("--method align needs calibration text: --calib FILE")
        from kvslim.tokenizer.tokenizer import Tokenizer
        from kvslim.surgery.align import align_state_dict
        state = align_state_dict(model, Tokenizer.from_dir(src), kv_heads, calib, calib_samples,
                                 calib_seq_len, show_progress)
    else:
        state = convert_state_dict(model.hf_state_dict(), config, kv_heads, method, seed)
    new_config = config.replace(num_key_value_heads=max(kv_heads), layer_kv_heads=tuple(kv_heads))
    out = save_model(state, new_config, dst, tokenizer_from=src)
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    return out


ALLOCATIONS = ("sensitivity", "uniform")


def convert_to_budget(src: str | Path, dst: str | Path, allocation: str = "sensitivity",
                      kv_budget: float | None = None, kv_bytes_per_token: int | None = None,
                      method: str = "align", calib: str | Path | None = None,
                      calib_samples: int = 32, calib_seq_len: int = 256,
                      sensitivity_samples: int = 8, seed: int = 0,
                      show_progress: bool = True) -> Path:
    """Write `dst` with per-layer KV heads chosen under a budget (a fraction of the source's KV
    bytes, or bytes per token): `uniform` keeps the same count everywhere, `sensitivity` spends
    the budget where merging costs most (surgery/sensitivity.py). The allocation and the
    measured costs are written beside the model as kv_allocation.json."""
    import json

    from kvslim.surgery.kv_budget import allocate, heads_budget, uniform_allocation
    if allocation not in ALLOCATIONS:
        raise KvslimError(f"unknown --allocate {allocation!r}; choose one of "
                          f"{', '.join(ALLOCATIONS)}")
    if method not in METHODS:
        raise KvslimError(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
    config = ModelConfig.from_dir(src)
    check_method(config, method)
    budget = heads_budget(config, kv_budget, kv_bytes_per_token)
    if (allocation == "sensitivity" or method == "align") and calib is None:
        raise KvslimError(f"--allocate {allocation} --method {method} needs calibration text: "
                          "--calib FILE")
    model = load_model(src, dtype=torch.float32)
    costs = None
    if allocation == "uniform":
        targets = uniform_allocation(config, budget)
    else:
        from kvslim.tokenizer.tokenizer import Tokenizer
        from kvslim.surgery.sensitivity import layer_sensitivity
        costs = layer_sensitivity(model, Tokenizer.from_dir(src), calib, method,
                                  sensitivity_samples, calib_seq_len, calib_samples,
                                  show_progress)
        targets = allocate(costs, budget)
    record = {"allocation": allocation, "method": method, "budget_kv_heads": budget,
              "source_kv_heads": list(config.kv_heads_per_layer), "kv_heads": targets,
              "predicted_kl": None if costs is None else sum(c[k] for c, k in zip(costs, targets)),
              "layer_kl": None if costs is None else [{str(k): v for k, v in c.items()}
                                                      for c in costs]}
    return convert_to_gqa(src, dst, targets, method, calib, calib_samples, calib_seq_len, seed,
                          show_progress, model=model,
                          extra_files={"kv_allocation.json": json.dumps(record, indent=1) + "\n"})
