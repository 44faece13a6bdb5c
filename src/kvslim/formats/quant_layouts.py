"""Checkpoints quantized in another tool's layout, read as the GPTQ-layout tensors `GPTQLinear`
holds, so the layers, their kernels and `prepare_for_inference` are the same for every format.

Each layout (one file each: awq.py, compressed_tensors.py) says which tensors one quantized
linear layer stores, their shapes, and how they become GPTQ tensors with the same codes, zero
points and scales (bit for bit; scales keep their stored dtype and are cast on copy like a GPTQ
checkpoint's). `gptq_weights` streams a checkpoint through it: a layer's tensors are collected
until all of them have been read (they may sit in different shard files) and converted then;
every other tensor (norms, embeddings, biases, lm_head) passes through as stored."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvslim.errors import WeightsError
from kvslim.formats import awq, compressed_tensors
from kvslim.quantization.base import QuantSpec

Shapes = dict[str, tuple[tuple[int, ...], str]]
Stored = Iterator[tuple[Path, str, torch.Tensor]]


@dataclass(frozen=True)
class Layout:
    name: str
    leaves: Callable[[QuantSpec], tuple[str, ...]]
    stored_shapes: Callable[[QuantSpec, int, int], Shapes]
    to_gptq: Callable[[str, dict[str, torch.Tensor], QuantSpec], dict[str, torch.Tensor]]


# QuantSpec.method -> its layout.
LAYOUTS = {
    "awq": Layout("AWQ GEMM", awq.leaves, awq.stored_shapes, awq.to_gptq),
    "compressed-tensors": Layout("compressed-tensors pack-quantized", compressed_tensors.leaves,
                                 compressed_tensors.stored_shapes, compressed_tensors.to_gptq),
}
DTYPE_KINDS = {"int32": lambda d: d == torch.int32,
               "int": lambda d: not d.is_floating_point and d != torch.bool,
               "float": lambda d: d.is_floating_point}


def gptq_weights(spec: QuantSpec, stored: Stored, expected: dict[str, torch.Size]) -> Stored:
    """(file, name, tensor) of the checkpoint with each quantized layer's tensors replaced by
    its GPTQ tensors. `expected` (the model's tensors by checkpoint name) says which layers the
    model runs quantized and their sizes."""
    layout = LAYOUTS[spec.method]
    leaves = set(layout.leaves(spec))
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for path, name, tensor in stored:
        prefix, _, leaf = name.rpartition(".")
        quantized = f"{prefix}.qweight" in expected
        if leaf not in leaves:
            if leaf == "weight" and quantized:
                raise WeightsError(f"{path.name}: {name!r} is stored unquantized (left out by "
                                   "the quantization config's ignore list?); kvslim runs every "
                                   "decoder linear layer of a quantized model quantized")
            yield path, name, tensor
            continue
        if not quantized:
            raise WeightsError(f"{path.name}: {prefix!r} is stored quantized ({layout.name}); "
                               "kvslim runs it unquantized and cannot load it")
        _check(path, name, tensor, _layer_shapes(layout, spec, expected, prefix)[leaf])
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if len(parts) == len(leaves):
            del pending[prefix]
            for leaf, t in layout.to_gptq(prefix, parts, spec).items():
                yield path, f"{prefix}.{leaf}", t
    for prefix, parts in pending.items():
        missing = sorted(leaves - set(parts))
        raise WeightsError(f"missing weight '{prefix}.{missing[0]}' ({layout.name} stores "
                           f"{', '.join(sorted(leaves))} per layer)")


def _layer_shapes(layout: Layout, spec: QuantSpec, expected: dict[str, torch.Size],
                  prefix: str) -> Shapes:
    packed_in, out_features = expected[f"{prefix}.qweight"]      # GPTQ: [in / pack, out]
    return layout.stored_shapes(spec, out_features, packed_in * spec.pack)


def _check(path: Path, name: str, tensor: torch.Tensor, want: tuple[tuple[int, ...], str]
           ) -> None:
    shape, kind = want
    if tuple(tensor.shape) != shape:
        raise WeightsError(f"{path.name}: weight {name!r} has shape {list(tensor.shape)}, "
                           f"expected {list(shape)} from config.json")
    if not DTYPE_KINDS[kind](tensor.dtype):
        raise WeightsError(f"{path.name}: weight {name!r} is {str(tensor.dtype)[6:]}, "
                           f"expected {kind}")
