"""Rotary position embeddings (RoPE) with the `linear`, `llama3`, `yarn` and `longrope` (Phi-3's,
also spelled `su`) frequency scalings. (`dynamic` NTK changes every frequency with the current
sequence's length, which a batch of sequences of different lengths does not have, and cached
keys would keep the old ones: config.py refuses it.)

LongRoPE scales each frequency by `short_factor` within the original context and by
`long_factor` beyond it. transformers chooses one set for a whole forward pass by its longest
position, and its Phi-3 generation recomputes the cache with the long set when a sequence first
outgrows the original context: every position of a sequence longer than the original context is
rotated by the long set, every position of a shorter one by the short set. kvslim does the same:
`cos_sin` rotates a position by the long set when it lies beyond the original context or when
the caller says its sequence outgrew it (`long`; the dense forward pass: its longest position,
the engine: a flag per sequence, whose K/V the scheduler recomputes when it crosses over).

cos/sin are computed from positions on the fly in float32, like the reference implementation,
so that any position (also after preemption or prefix-cache hits) is exact."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvslim.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Those whose frequencies do not depend on the context: any position is defined, so a windowed
# cache (kv_cache/window.py) may run past max_position_embeddings. LongRoPE's long factors were
# fitted for contexts up to the model's.
ROPE_TYPES_PAST_CONTEXT = tuple(t for t in SUPPORTED_ROPE_TYPES if t != "longrope")
# Those that scale frequencies only: no attention factor (yarn's) and no switch with the length
# (LongRoPE's), so a converted model's RoPE is the source's frequencies (surgery/mla).
FREQUENCY_ONLY_ROPE_TYPES = tuple(t for t in SUPPORTED_ROPE_TYPES if t not in ("yarn", "longrope"))
# The fields each scaling cannot do without.
_REQUIRED = {"yarn": ("factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}


def validate_rope_scaling(scaling: dict[str, Any], head_dim: int) -> None:
    """A config.json rope_scaling this module can run, or a one-line ConfigError naming why not."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"config.json: unsupported rope_scaling type {rope_type!r}; "
                          f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    missing = [k for k in _REQUIRED.get(rope_type, ()) if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"config.json: {rope_type} rope_scaling needs {', '.join(missing)}")
    for key in ("short_factor", "long_factor") if rope_type == "longrope" else ():
        if len(scaling[key]) != head_dim // 2:
            raise ConfigError(f"config.json: longrope {key} has {len(scaling[key])} entries, "
                              f"expected head_dim / 2 = {head_dim // 2}")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if rope_type == "longrope":
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def longrope_original_context(scaling: dict[str, Any] | None) -> int | None:
    """The sequence length beyond which LongRoPE rotates every position by its long factors;
    None for any other scaling."""
    if (scaling or {}).get("rope_type") != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"])


def longrope_long_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """LongRoPE's frequencies beyond the original context."""
    inv_freq = rope_inv_freq(head_dim, theta, None)
    return inv_freq / torch.tensor(scaling["long_factor"], dtype=torch.float32)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1, except for YaRN, whose softmax temperature is
    folded in there (0.1 ln(factor) + 1 by default, as in the paper and transformers), and
    LongRoPE (sqrt(1 + ln(factor) / ln(original context)))."""
    rope_type = (scaling or {}).get("rope_type")
    if rope_type == "longrope":
        return _longrope_attention_factor(scaling)
    if rope_type != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _longrope_attention_factor(scaling: dict[str, Any]) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, old_len = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def _yarn_factor(scaling: dict[str, Any]) -> float:
    return float(scaling["factor"])          # present: config.py checks


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    """NTK-by-parts (Peng et al., 2023): dimensions that rotate fewer than beta_slow times over
    the original context are interpolated by `factor`, those that rotate more than beta_fast
    times are kept, the band between is ramped linearly."""
    factor, old_len = _yarn_factor(scaling), float(scaling["original_max_position_embeddings"])
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                       # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp                         # 1: extrapolate (keep), 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.attention_factor = rope_attention_factor(scaling)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        # LongRoPE: the frequencies from `long_from` on (the original context's length).
        self.long_from = longrope_original_context(scaling)
        if self.long_from is not None:
            self.register_buffer("long_inv_freq", longrope_long_inv_freq(head_dim, theta, scaling),
                                 persistent=False)

    def reset(self, device: torch.device) -> None:
        """Recompute the frequencies on `device` (after a model built on the meta device is
        allocated: they are not in any checkpoint)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        if self.long_from is not None:
            self.long_inv_freq = longrope_long_inv_freq(self.head_dim, self.theta,
                                                        self.scaling).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                long: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., head_dim], in the activation dtype. LongRoPE: a
        position takes the long factors from the original context on, and also below it where
        `long` (bool, positions' shape) says its sequence is longer than the original context."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        if self.long_from is not None:
            long_freqs = positions[..., None].float() * self.long_inv_freq.to(positions.device)
            use_long = positions >= self.long_from
            if long is not None:
                use_long = use_long | long
            freqs = torch.where(use_long[..., None], long_freqs, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return ((emb.cos() * self.attention_factor).to(dtype),
                    (emb.sin() * self.attention_factor).to(dtype))
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def long_for_pass(self, positions: torch.Tensor) -> torch.Tensor | None:
        """`long` for a dense forward pass, as transformers decides it: every position takes
        the long factors when the pass's longest position lies beyond the original context.
        None when the scaling is not LongRoPE."""
        if self.long_from is None:
            return None
        return (positions.max() >= self.long_from).expand(positions.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim]; cos/sin [..., head_dim] broadcast over heads (half-split layout)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
