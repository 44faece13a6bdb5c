"""GPTQ: weight-only quantized linear layers that hold their weights in the GPTQ checkpoint
layout (docs/quantization-formats.md), so a checkpoint's tensors are copied in as they are
stored:

    qweight int32 [in * bits / 32, out]   values packed along the input dim, lowest bits first
    qzeros  int32 [groups, out * bits / 32]   zero points packed along the output dim
    scales        [groups, out]
    g_idx   int32 [in]                     the group of each input channel (act-order permutes it)

w[o, i] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]. The fused layers (q/k/v,
gate/up) concatenate their checkpoint shards along the output dim: qweight, qzeros and scales
by columns, and keep one g_idx row per shard, so shards quantized with different act-order
permutations still load. AWQ and compressed-tensors pack-quantized checkpoints are converted to
these tensors at load (formats/quant_layouts.py) and run as `GPTQLinear` too (awq.py,
compressed_tensors.py register it)."""
from __future__ import annotations

from functools import partial
from typing import Any, Hashable

import torch
import torch.nn.functional as F

from kvslim.errors import ConfigError
from kvslim.kernels import activations, tiled_gemm
from kvslim.quantization.base import QuantLinear, QuantSpec
from kvslim.quantization.kernels import (Int4Weight, int4_linear, int8_kernel_scales, int8_linear,
                                         pack_int4)
from kvslim.quantization.registry import register

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
LEAVES = ("qweight", "qzeros", "scales", "g_idx", "bias")      # checkpoint order per module


def gptq_spec(cfg: dict[str, Any]) -> QuantSpec:
    """config.json `quantization_config` with quant_method "gptq" (AutoGPTQ, GPTQModel)."""
    fmt = cfg.get("checkpoint_format", "gptq")
    bits, group = cfg.get("bits"), cfg.get("group_size", -1)
    if bits not in (4, 8):
        raise ConfigError(f"config.json: quantization_config bits {bits!r} is not supported "
                          "(4 or 8)")
    if fmt not in CHECKPOINT_FORMATS:
        raise ConfigError(f"config.json: quantization_config checkpoint_format {fmt!r} is not "
                          f"supported ({' or '.join(CHECKPOINT_FORMATS)})")
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise ConfigError(f"config.json: quantization_config group_size {group!r} must be a "
                          "positive integer or -1")
    return QuantSpec(bits, group, bool(cfg.get("desc_act", False)), bool(cfg.get("sym", True)),
                     fmt)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integers in [0, 2**bits) -> int32 words, 32 // bits consecutive values along `dim` per
    word, the first in the lowest bits."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % per:
        raise ValueError(f"{v.shape[-1]} values do not pack into whole int32 words of {per}")
    v = v.reshape(*v.shape[:-1], -1, per) & (2 ** bits - 1)
    words = (v << (torch.arange(per, device=v.device) * bits)).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)      # two's complement
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `pack_int32`: int64 values in [0, 2**bits)."""
    per = 32 // bits
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    v = (w.unsqueeze(-1) >> (torch.arange(per, device=w.device) * bits)) & (2 ** bits - 1)
    return v.reshape(*w.shape[:-1], -1).movedim(-1, dim)

class GPTQLinear(QuantLinear):
    """A linear layer in the GPTQ layout (the module docstring)."""
    LEAVES = LEAVES
    ROW_MAJOR = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 spec: QuantSpec | None = None, shard_sizes: dict[Hashable, int] | None = None):
        super().__init__(in_features, out_features, bias, spec, shard_sizes)
        spec = self.spec
        uneven = [s for s in (in_features, *self.shard_sizes.values()) if s % spec.pack]
        if uneven:
            raise ConfigError(f"a {spec.bits}-bit GPTQ layer needs sizes divisible by {spec.pack}, "
                              f"got {uneven[0]}")
        groups, out = spec.num_groups(in_features), self.out_features
        self.register_buffer("qweight", torch.zeros(in_features // spec.pack, out,
                                                    dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(groups, out // spec.pack, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(groups, out))
        self.register_buffer("g_idx", torch.zeros(len(self.shard_sizes), in_features,
                                                  dtype=torch.int32))

    @classmethod
    def input_multiple(cls, spec: QuantSpec) -> int:
        """The int32 word qweight packs along the inputs: 32 / bits values."""
        return spec.pack

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] in the scales' dtype."""
        q = unpack_int32(self.qweight, self.spec.bits, 0)                     # [in, out]
        zeros = self.spec.zeros_from_stored(unpack_int32(self.qzeros, self.spec.bits, 1))
        idx = torch.cat([g.long().unsqueeze(1).expand(-1, size)
                         for g, size in zip(self.g_idx, self.shard_sizes.values())], dim=1)
        w = (q - zeros.gather(0, idx)).to(self.scales.dtype) * self.scales.gather(0, idx)
        return w.t()

    @torch.no_grad()
    def prepare_for_inference(self) -> None:
        """Choose the kernel once the weights are loaded (`kvslim bench kernels` measured them;
        see quantization/kernels.py). 8-bit layers with one symmetric group per output channel
        run kvslim's group kernel with one group (kernels/tiled_gemm.py; `int8_linear` without
        the extension); 4-bit layers whose shards share one group order run `int4_linear`
        (act-order: the inputs are permuted into group order first); anything else is
        dequantized once here, so no call pays for it again."""
        per_channel = self._int8_per_channel() if self.spec.bits == 8 else None
        if per_channel is not None:
            weight, scales = per_channel
            if weight.device.type == "cpu" and tiled_gemm.available():
                packed = activations.pack(weight, scales[:, None], None, 8)
                self.kernel = partial(activations.group_forward, weight=packed, bias=self.bias)
            else:
                self.kernel = partial(int8_linear, qweight=weight,
                                      scales=int8_kernel_scales(scales), bias=self.bias)
            return
        packed = self._int4_packed() if self.spec.bits == 4 else None
        if packed is not None:
            weight, perm = packed
            self.kernel = partial(_int4_forward, weight=weight, perm=perm, bias=self.bias)
            return
        dense = self.dequantized_weight().float()
        self.kernel = partial(_dense_forward, weight=dense, bias=self.bias)

    def _int8_per_channel(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """8 bits, one group, symmetric (every zero point 128): w = (q - 128) * scale is an
        int8 weight with one scale per output channel, what `int8_linear` runs."""
        if self.scales.shape[0] != 1:
            return None
        zeros = self.spec.zeros_from_stored(unpack_int32(self.qzeros, 8, 1))
        if not bool((zeros == 128).all()):
            return None
        q = unpack_int32(self.qweight, 8, 0).t() - 128                       # [out, in]
        return q.to(torch.int8).contiguous(), self.scales[0].float()

    def _int4_packed(self) -> tuple[Int4Weight, torch.Tensor | None] | None:
        """The layer as one Int4Weight over its inputs in group order, or None when its shards
        order their groups differently or the groups are uneven."""
        g_idx = self.g_idx[0].long()
        group = self.spec.group_size if self.spec.group_size > 0 else self.in_features
        if any(not torch.equal(g.long(), g_idx) for g in self.g_idx[1:]) or self.in_features % group:
            return None
        perm = torch.argsort(g_idx, stable=True)
        inputs = torch.arange(self.in_features, device=g_idx.device)
        if not torch.equal(g_idx[perm], inputs // group):
            return None
        q = unpack_int32(self.qweight, 4, 0)[perm].t()                       # [out, in]
        zeros = self.spec.zeros_from_stored(unpack_int32(self.qzeros, 4, 1)).t()
        weight = pack_int4(q, self.scales.t().float(), zeros.float(), group)
        identity = torch.equal(perm, inputs)
        return weight, None if identity else perm

    # ---- checkpoint tensors ----------------------------------------------------------------
    def shard_view(self, leaf: str, shard_id: Hashable) -> torch.Tensor:
        """The part of buffer `leaf` that holds one checkpoint shard's tensor, as a view: its
        columns (qzeros: their packed words), its row of g_idx."""
        i, cols = self._shard(shard_id)
        tensor = getattr(self, leaf)
        if leaf == "g_idx":
            return tensor[i]
        if leaf == "bias":
            return tensor[cols]
        if leaf == "qzeros":
            return tensor[:, cols.start // self.spec.pack:cols.stop // self.spec.pack]
        return tensor[:, cols]


def _int4_forward(x: torch.Tensor, weight: Int4Weight, perm: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    if perm is not None:
        x = x.index_select(-1, perm)
    return int4_linear(x, weight, bias)


def _dense_forward(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype), bias)


def gptq_config(spec: QuantSpec) -> dict:
    """config.json's `quantization_config` for `spec`, with the fields AutoGPTQ and GPTQModel
    write."""
    return {"quant_method": "gptq", "bits": spec.bits, "group_size": spec.group_size,
            "desc_act": spec.desc_act, "sym": spec.sym,
            "checkpoint_format": spec.checkpoint_format, "static_groups": False,
            "true_sequential": True, "damp_percent": 0.01}


register("gptq", GPTQLinear, "gptq", gptq_spec, gptq_config)
