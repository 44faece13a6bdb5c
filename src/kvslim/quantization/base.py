"""What every quantization method shares: `QuantSpec`, how a checkpoint's linear layers are
quantized (parsed from config.json's `quantization_config` by the method's registered parser),
and `QuantLinear`, the interface each method's layer class implements.

`QuantLinear` holds one linear layer, or several checkpoint matrices (shards) stacked along the
output as the float `ShardedLinear` does, in the method's own tensors (its `LEAVES`), loads them
from the checkpoint (`weight_loader`), gives them back (`checkpoint_views`), and runs
`Linear`'s contract, x [..., in] -> [..., out]: dequantized in plain torch until
`prepare_for_inference` picks the kernel (`kernel`)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.errors import ConfigError
from kvslim.layers.linear import prepare_float_linears
from kvslim.quantization.registry import QUANT_METHODS, linear_class, parser, writer


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
                                       # "w8a8": compressed-tensors int-quantized (w8a8.py)
    file: str | None = None            # method "gguf": the file, relative to the model dir
    embedding: bool = False            # method "gguf": token embeddings (and a tied LM head)
    lm_head: bool = False              # method "gguf": an untied LM head, quantized in the file

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "QuantSpec":
        method = cfg.get("quant_method")
        parse = parser(method) if isinstance(method, str) else None
        if parse is None:
            names = [repr(name) for name in QUANT_METHODS]
            raise ConfigError(f"config.json: quantization_config quant_method {method!r} is not "
                              f"supported ({', '.join(names[:-1])} or {names[-1]})")
        return parse(cfg)

    def to_hf(self) -> dict[str, Any]:
        """config.json's `quantization_config` for this spec, as its method's file writes it."""
        write = writer(self.method)
        if write is None:
            raise ConfigError(f"kvslim reads {self.method} checkpoints but does not write them")
        return write(self)

    def make_linear(self, in_features: int, shard_sizes: dict[Hashable, int],
                    bias: bool = False) -> "QuantLinear":
        """A linear layer of this method (`layers.linear.make_linear` asks for it)."""
        return linear_class(self.method)(in_features, 0, bias, self, shard_sizes)

    @property
    def input_multiple(self) -> int:
        """What the method's layers need of a slice of their inputs
        (`QuantLinear.input_multiple`)."""
        return linear_class(self.method).input_multiple(self)

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


class QuantLinear(nn.Module, ABC):
    """A linear layer whose weight is stored quantized; several checkpoint matrices (shards)
    may be stacked along the output, as in `ShardedLinear`. One shard, named None, by default;
    a shard is also reachable by its index (gate/up as 0/1). Subclasses lay out their tensors
    after this `__init__`."""
    LEAVES: tuple[str, ...] = ()     # the checkpoint tensors of one shard, in checkpoint order
    # Every tensor [out, ...], shards as row blocks (W8A8, GGUF blocks); else GPTQ's column-
    # major layout. Tensor parallelism cuts by it (parallel/quant_layers.py).
    ROW_MAJOR = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 spec: QuantSpec | None = None, shard_sizes: dict[Hashable, int] | None = None):
        super().__init__()
        if spec is None:
            raise ValueError(f"{type(self).__name__} needs a QuantSpec")
        self.spec = spec
        self.shard_sizes = dict(shard_sizes or {None: out_features})
        self.in_features, self.out_features = in_features, sum(self.shard_sizes.values())
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return self.unprepared_forward(x)

    def unprepared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Before `prepare_for_inference`: the dequantized weight through F.linear."""
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)

    @classmethod
    def input_multiple(cls, spec: QuantSpec) -> int:
        """How many inputs a slice of this layer's inputs (a row-parallel shard) must be a
        multiple of, for its tensors to be cut where they are packed: 1, any."""
        return 1

    @abstractmethod
    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] as floats."""

    @abstractmethod
    def prepare_for_inference(self) -> None:
        """Choose `kernel` once the weights are loaded; they must not change afterwards."""

    # ---- checkpoint tensors ----------------------------------------------------------------
    def shard_key(self, shard_id: Hashable) -> Hashable:
        if isinstance(shard_id, int):
            return list(self.shard_sizes)[shard_id]
        return shard_id

    def _shard(self, shard_id: Hashable) -> tuple[int, slice]:
        """The shard's index and its output rows."""
        key, start = self.shard_key(shard_id), 0
        for i, (name, size) in enumerate(self.shard_sizes.items()):
            if name == key:
                return i, slice(start, start + size)
            start += size
        raise KeyError(f"no shard {key!r} in {list(self.shard_sizes)}")

    def shard_view(self, leaf: str, shard_id: Hashable) -> torch.Tensor:
        """The part of buffer `leaf` that holds one checkpoint shard's tensor, as a view (row
        major: its rows)."""
        _, rows = self._shard(shard_id)
        return getattr(self, leaf)[rows]

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


def prepare_linears_for_inference(model: nn.Module) -> bool:
    """Choose every linear layer's kernel once the weights are loaded: each quantized layer its
    own (`QuantLinear.prepare_for_inference`), then the float ones
    (`layers.linear.prepare_float_linears`). Returns whether those run the packed CPU kernel."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.prepare_for_inference()
    return prepare_float_linears(model)
