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

METHODS = ("mean", "first", "random", "align")


def check_target(config: ModelConfig, kv_heads: int) -> None:
    k0 = config.num_key_value_heads
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise KvslimError(f"--kv-heads must be a positive integer, got {kv_heads}")
    if kv_heads > k0:
        raise KvslimError(f"--kv-heads {kv_heads} is more than the model's "
                          f"{k0} KV heads; conversion only pools heads")
    if k0 % kv_heads != 0:
        raise KvslimError(f"--kv-heads {kv_heads} does not divide the model's {k0} KV heads "
                          f"(num_attention_heads={config.num_attention_heads})")


def pool_heads(weight: torch.Tensor, num_heads: int, kv_heads: int, method: str,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """weight [num_heads * d, ...] (rows of a k/v projection or its bias) -> [kv_heads * d, ...]."""
    per = num_heads // kv_heads
    heads = weight.reshape(kv_heads, per, -1, *weight.shape[1:])   # [K, per, d, ...]
    if method == "mean":
        pooled = heads.mean(dim=1)
    elif method == "first":
        pooled = heads[:, 0]
    elif method == "random":
        std = weight.float().std().item() if weight.dim() > 1 else 0.0
        pooled = torch.randn(heads[:, 0].shape, generator=generator) * std
    else:
        raise KvslimError(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
    return pooled.reshape(-1, *weight.shape[1:]).to(weight.dtype)


def convert_state_dict(state: dict[str, torch.Tensor], config: ModelConfig, kv_heads: int,
                       method: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Pool every layer's k_proj / v_proj rows (and biases) by `method` (mean, first, random)."""
    check_target(config, kv_heads)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            out[name] = pool_heads(tensor, config.num_key_value_heads, kv_heads, method, gen)
        else:
            out[name] = tensor.clone()
    return out


def convert_to_gqa(src: str | Path, dst: str | Path, kv_heads: int, method: str = "mean",
                   calib: str | Path | None = None, calib_samples: int = 32,
                   calib_seq_len: int = 256, seed: int = 0, show_progress: bool = True) -> Path:
    """Write `dst`: the model at `src` with `kv_heads` KV heads, loadable by kvslim and HF."""
    if method not in METHODS:
        raise KvslimError(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
    model = load_model(src, dtype=torch.float32)
    config = model.config
    check_target(config, kv_heads)
    if method == "align":
        if calib is None:
            raise KvslimError("--method align needs calibration text: --calib FILE")
        from kvslim.tokenizer.tokenizer import Tokenizer
        from kvslim.surgery.align import align_state_dict
        state = align_state_dict(model, Tokenizer.from_dir(src), kv_heads, calib, calib_samples,
                                 calib_seq_len, show_progress)
    else:
        state = convert_state_dict(model.hf_state_dict(), config, kv_heads, method, seed)
    new_config = config.replace(num_key_value_heads=kv_heads)
    return save_model(state, new_config, dst, tokenizer_from=src)
