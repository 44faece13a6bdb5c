"""Weight-only quantized linear layers that hold their weights in the GPTQ checkpoint layout
(docs/quantization-formats.md), so a checkpoint's tensors are copied in as they are stored:

    qweight int32 [in * bits / 32, out]   values packed along the input dim, lowest bits first
    qzeros  int32 [groups, out * bits / 32]   zero points packed along the output dim
    scales        [groups, out]
    g_idx   int32 [in]                     the group of each input channel (act-order permutes it)

w[o, i] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]. The fused variants (q/k/v,
gate/up) concatenate their checkpoint shards along the output dim: qweight, qzeros and scales
by columns, and keep one g_idx row per shard, so shards quantized with different act-order
permutations still load. `forward` keeps `Linear`'s contract (x [..., in] -> [..., out]); it
dequantizes in plain torch until `prepare_for_inference` picks a faster kernel."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.errors import ConfigError
from kvslim.layers.quant_kernels import Int4Weight, int4_linear, int8_linear, pack_int4

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
LEAVES = ("qweight", "qzeros", "scales", "g_idx", "bias")      # checkpoint order per module


@dataclass(frozen=True)
class QuantSpec:
    """How a checkpoint's linear layers are quantized (its config.json `quantization_config`)."""
    bits: int
    group_size: int                    # -1: one group spans all input features
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"    # "gptq" (v1) stores zero - 1; the others the zero itself
    method: str = "gptq"               # "gguf": blocks read from a GGUF file; "awq",
                                       # "compressed-tensors": converted to this layout at load;
                                       # "w8a8": compressed-tensors int-quantized (w8a8_linear.py)
    file: str | None = None            # method "gguf": the file, relative to the model dir
    embedding: bool = False            # method "gguf": token embeddings (and a tied LM head)
    lm_head: bool = False              # method "gguf": an untied LM head, quantized in the file

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "QuantSpec":
        method = cfg.get("quant_method")
        if method == "gguf":
            file = cfg.get("file")
            if not isinstance(file, str) or not file:
                raise ConfigError("config.json: quantization_config quant_method 'gguf' needs "
                                  "'file', the GGUF file's name")
            return cls(4, 32, sym=False, checkpoint_format="gguf", method="gguf", file=file,
                       embedding=bool(cfg.get("embedding", False)),
                       lm_head=bool(cfg.get("lm_head", False)))
        # Other tools' layouts: parsed beside this class, converted to this layout at load.
        if method == "awq":
            from kvslim.layers.awq_config import awq_spec
            return awq_spec(cfg)
        if method == "compressed-tensors":
            from kvslim.layers.compressed_tensors_config import compressed_tensors_spec
            return compressed_tensors_spec(cfg)
        if method != "gptq":
            raise ConfigError(f"config.json: quantization_config quant_method {method!r} is not "
                              "supported ('gptq', 'awq', 'compressed-tensors' or 'gguf')")
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
        return cls(bits, group, bool(cfg.get("desc_act", False)), bool(cfg.get("sym", True)), fmt)

    def describe(self) -> str:
        """One line for people: `kvslim info`."""
        if self.method == "gguf":
            kept = " and token embeddings" if self.embedding else ""
            return f"GGUF blocks kept quantized (linears{kept}), from {self.file}"
        if self.method == "w8a8":
            return "W8A8: int8 per-channel weights, int8 per-token activations (compressed-tensors)"
        group = "per channel" if self.group_size == -1 else f"groups of {self.group_size}"
        return (f"{self.bits}-bit {'symmetric' if self.sym else 'asymmetric'}, {group}"
                f"{', act-order' if self.desc_act else ''} ({self.method}, stored as "
                f"{self.checkpoint_format})")

    @property
    def pack(self) -> int:
        """Values per int32."""
        return 32 // self.bits

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def zeros_from_stored(self, stored: torch.Tensor) -> torch.Tensor:
        """Zero points from the unpacked qzeros. v1 stores zero - 1 and is read back as
        stored + 1 without wrapping, as AutoGPTQ's own dequantization does (qlinear_cuda_old,
        `(qzeros >> shift & mask) + 1`): a zero of 0, stored as 2**bits - 1, comes back as
        2**bits there, so kvslim computes what that checkpoint computes in AutoGPTQ."""
        if self.checkpoint_format == "gptq":
            return stored + 1
        return stored

    def zeros_to_stored(self, zeros: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_format == "gptq":
            if bool((zeros == 0).any()):
                raise ConfigError("a zero point of 0 cannot be stored in checkpoint_format "
                                  "'gptq' (v1 reads it back as 2**bits); use 'gptq_v2'")
            return zeros - 1
        return zeros


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


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored quantized; several checkpoint matrices (shards)
    may be stacked along the output, as in `ShardedLinear`. One shard, named None, by default."""
    LEAVES = LEAVES

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 spec: QuantSpec | None = None, shard_sizes: dict[Hashable, int] | None = None):
        super().__init__()
        if spec is None:
            raise ValueError("QuantLinear needs a QuantSpec")
        self.spec = spec
        self.shard_sizes = dict(shard_sizes or {None: out_features})
        self.in_features, self.out_features = in_features, sum(self.shard_sizes.values())
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
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)

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
        see layers/quant_kernels.py). 8-bit layers with one symmetric group per output channel
        run `int8_linear`; 4-bit layers whose shards share one group order run `int4_linear`
        (act-order: the inputs are permuted into group order first); anything else is
        dequantized once here, so no call pays for it again."""
        per_channel = self._int8_per_channel() if self.spec.bits == 8 else None
        if per_channel is not None:
            weight, scales = per_channel
            self.kernel = partial(int8_linear, qweight=weight, scales=scales, bias=self.bias)
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
        if not torch.equal(g_idx[perm], torch.arange(self.in_features) // group):
            return None
        q = unpack_int32(self.qweight, 4, 0)[perm].t()                       # [out, in]
        zeros = self.spec.zeros_from_stored(unpack_int32(self.qzeros, 4, 1)).t()
        weight = pack_int4(q, self.scales.t().float(), zeros.float(), group)
        identity = torch.equal(perm, torch.arange(self.in_features))
        return weight, None if identity else perm

    # ---- checkpoint tensors ----------------------------------------------------------------
    def shard_key(self, shard_id: Hashable) -> Hashable:
        return shard_id

    def _shard(self, shard_id: Hashable) -> tuple[int, slice]:
        key, start = self.shard_key(shard_id), 0
        for i, (name, size) in enumerate(self.shard_sizes.items()):
            if name == key:
                return i, slice(start, start + size)
            start += size
        raise KeyError(f"no shard {key!r} in {list(self.shard_sizes)}")

    def shard_view(self, leaf: str, shard_id: Hashable) -> torch.Tensor:
        """The part of buffer `leaf` that holds one checkpoint shard's tensor, as a view."""
        i, cols = self._shard(shard_id)
        tensor = getattr(self, leaf)
        if leaf == "g_idx":
            return tensor[i]
        if leaf == "bias":
            return tensor[cols]
        if leaf == "qzeros":
            return tensor[:, cols.start // self.spec.pack:cols.stop // self.spec.pack]
        return tensor[:, cols]

    def checkpoint_views(self) -> dict[Hashable, dict[str, torch.Tensor]]:
        """Per shard, its checkpoint tensors (views of this layer's buffers) by leaf name."""
        leaves = [leaf for leaf in self.LEAVES if getattr(self, leaf) is not None]
        return {key: {leaf: self.shard_view(leaf, key) for leaf in leaves}
                for key in self.shard_sizes}

    @torch.no_grad()
    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      shard_id: Hashable | None = None) -> None:
        """Copy one checkpoint tensor (`param` is the buffer or parameter it belongs to)."""
        leaf = next(name for name in self.LEAVES if getattr(self, name) is param)
        self.shard_view(leaf, shard_id).copy_(loaded_weight)


class QuantQKVLinear(QuantLinear):
    """Quantized q, k and v projections in one layer: columns q, then k, then v."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, spec: QuantSpec | None = None):
        super().__init__(hidden, 0, bias, spec, {"q": num_heads * head_dim,
                                                 "k": num_kv_heads * head_dim,
                                                 "v": num_kv_heads * head_dim})


class QuantMergedLinear(QuantLinear):
    """Quantized projections of equal input side by side (gate then up); shard ids are their
    index (0, 1) or their name."""

    def __init__(self, in_features: int, names: tuple[str, ...], out_features: int,
                 bias: bool = False, spec: QuantSpec | None = None):
        super().__init__(in_features, 0, bias, spec, {name: out_features for name in names})

    def shard_key(self, shard_id: Hashable) -> Hashable:
        return list(self.shard_sizes)[shard_id] if isinstance(shard_id, int) else shard_id


def _int4_forward(x: torch.Tensor, weight: Int4Weight, perm: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    if perm is not None:
        x = x.index_select(-1, perm)
    return int4_linear(x, weight, bias)


def _dense_forward(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype), bias)
