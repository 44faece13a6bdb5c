"""Linear layers that load checkpoint weights into the form they run in.

The fused layers (`QKVLinear`, `MergedLinear`) hold several checkpoint matrices as row blocks of
one weight: one GEMM instead of three (q/k/v) or two (gate/up) per decoder layer, which on a CPU
decode step — where each op costs a few microseconds of framework overhead — is a measurable
share of the step. Each layer knows how a checkpoint shard goes into its weight
(`weight_loader`) and how to give the shards back (`shard_views`), so training, saving and
surgery still see HF-named tensors. After loading, `prepare_for_inference` chooses the kernel
once (`kvslim.layers.cpu_linear` on float32 CPU models, F.linear elsewhere).

`make_linear` builds every linear layer of a model's blocks: these float ones, or a quantized
method's layer (`kvslim.quantization`), which the quantization scheme itself builds
(`LinearQuantization`): that room imports layers/, so layers/ names only the interface."""
from __future__ import annotations

import math
from typing import Hashable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.kernels import tiled_gemm
from kvslim.layers.cpu_linear import (PackedCpuKernel, Sparse24CpuKernel, TiledCpuKernel,
                                      gemv_copy_fits, is_two_of_four, packed_kernel_usable)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel: PackedCpuKernel | TiledCpuKernel | Sparse24CpuKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Hashable | None = None) -> None:
        param.copy_(loaded_weight)

    @torch.no_grad()
    def prepare_for_inference(self, gemv_copy: bool, release_weight: bool) -> None:
        """Switch to the CPU kernel: kvslim's 2:4 one for a 2:4 sparse weight, its tiled one
        where it builds, else oneDNN's packed one (layers/cpu_linear.py). The weights must not change afterwards. The weight
        parameter then shares the GEMV copy's memory (as its transpose), or, without that copy
        and when no other module shares it, becomes empty: the kernel's form is the only copy."""
        if tiled_gemm.available() and is_two_of_four(self.weight):
            self.kernel = Sparse24CpuKernel(self.weight, self.bias)
        elif tiled_gemm.available():
            self.kernel = TiledCpuKernel(self.weight, self.bias)
        else:
            self.kernel = PackedCpuKernel(self.weight, self.bias, gemv_copy)
        if release_weight:
            in_out = self.kernel.weight_in_out
            self.weight.data = in_out.t() if in_out is not None else self.weight.new_empty(0)


class ShardedLinear(Linear):
    """A linear layer whose output rows are several checkpoint matrices stacked in order."""

    def __init__(self, in_features: int, shard_sizes: dict[Hashable, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_sizes = dict(shard_sizes)

    def shard_rows(self, shard_id: Hashable) -> slice:
        shard_id = self.shard_key(shard_id)
        start = 0
        for key, size in self.shard_sizes.items():
            if key == shard_id:
                return slice(start, start + size)
            start += size
        raise KeyError(f"no shard {shard_id!r} in {list(self.shard_sizes)}")

    def shard_key(self, shard_id: Hashable) -> Hashable:
        return shard_id

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Hashable | None = None) -> None:
        param[self.shard_rows(shard_id)].copy_(loaded_weight)

    def shard_views(self, tensor: torch.Tensor) -> dict[Hashable, torch.Tensor]:
        """Each shard's rows of `tensor` (this layer's weight or bias), as views."""
        return {key: tensor[self.shard_rows(key)] for key in self.shard_sizes}


class QKVLinear(ShardedLinear):
    """q, k and v projections in one weight: rows q, then k, then v."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        super().__init__(hidden, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                  "v": num_kv_heads * head_dim}, bias)


class MergedLinear(ShardedLinear):
    """Projections of equal input stacked by rows (gate then up); shard ids are their index
    (0, 1) or their name."""

    def __init__(self, in_features: int, names: tuple[str, ...], out_features: int,
                 bias: bool = False):
        super().__init__(in_features, {name: out_features for name in names}, bias)

    def shard_key(self, shard_id: Hashable) -> Hashable:
        return list(self.shard_sizes)[shard_id] if isinstance(shard_id, int) else shard_id


class LinearQuantization(Protocol):
    """How a model's linear layers are quantized, as the layers see it (kvslim.quantization's
    `QuantSpec`): it builds the layer that holds a matrix, or stacked shards, in its form."""

    def make_linear(self, in_features: int, shard_sizes: dict[Hashable, int],
                    bias: bool = False) -> nn.Module: ...


def make_linear(in_features: int, out_features: int | dict[Hashable, int], bias: bool = False,
                quant: LinearQuantization | None = None) -> nn.Module:
    """The linear layer of one projection: `out_features` outputs, or the checkpoint matrices
    stacked along the output by name ("q"/"k"/"v": `QKVLinear`, "gate"/"up": `MergedLinear`),
    float, or quantized as `quant` says."""
    shard_sizes = (dict(out_features) if isinstance(out_features, dict)
                   else {None: out_features})
    if quant is not None:
        return quant.make_linear(in_features, shard_sizes, bias)
    names = tuple(shard_sizes)
    if names == (None,):
        return Linear(in_features, out_features, bias)
    if names == ("q", "k", "v") and shard_sizes["k"] == shard_sizes["v"]:
        # QKVLinear keeps only the three sizes: any head width dividing them gives them.
        width = math.gcd(shard_sizes["q"], shard_sizes["k"])
        return QKVLinear(in_features, width, shard_sizes["q"] // width,
                         shard_sizes["k"] // width, bias)
    if len(set(shard_sizes.values())) == 1:
        return MergedLinear(in_features, names, shard_sizes[names[0]], bias)
    raise ValueError(f"no float linear layer stacks shards {shard_sizes}")


def prepare_float_linears(model: nn.Module) -> bool:
    """Choose every float Linear's kernel once its weights are loaded. Returns whether they run
    the packed CPU kernel (False: F.linear, e.g. off the CPU or not float32)."""
    if not packed_kernel_usable(model):
        return False
    gemv_copy = gemv_copy_fits(model)
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepare_for_inference(gemv_copy, release_weight=seen[id(module.weight)] == 1)
    return True
