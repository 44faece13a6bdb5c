"""What the group-quantized linear layers' kernel does with its activations, chosen per engine
(`EngineConfig.linear_activations`, `--linear-activations`) around the model's
`prepare_for_inference`:

    int8      kernels/group_q8.py: x quantized to int8 per block of 32 (max |x| / 127), as
              llama.cpp runs its Q4/Q8 files; integer dot products (AVX-512 VNNI, AVX2 or
              scalar, the same bits), faster at every M (benchmarks/decode_gemm_stream.py), with
              llama.cpp's activation rounding (the default)
    float32   kernels/tiled_gemm.py: x stays float32; outputs are the dequantized weight's
              to float32 rounding: the exact reference

Both are batch-invariant by construction. int8 needs layers of whole blocks
(group_q8.usable); any other layer keeps float32."""
from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch

from kvslim.errors import ConfigError
from kvslim.kernels import group_q8, tiled_gemm

LINEAR_ACTIVATIONS = ("float32", "int8")
_chosen = contextvars.ContextVar("linear_activations", default="int8")


@contextmanager
def linear_activations(kind: str):
    """Layers packed inside take `kind` activations."""
    if kind not in LINEAR_ACTIVATIONS:
        raise ConfigError(f"linear_activations must be one of {', '.join(LINEAR_ACTIVATIONS)}, "
                          f"got {kind!r}")
    token = _chosen.set(kind)
    try:
        yield
    finally:
        _chosen.reset(token)


def pack(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int):
    """`tiled_gemm.pack_group_weight`'s arguments -> the chosen kernel's weight."""
    if (_chosen.get() == "int8" and group_q8.available()
            and group_q8.usable(q.shape[1], scales.shape[1])):
        return group_q8.pack_q8_weight(q, scales, mins, bits)
    return tiled_gemm.pack_group_weight(q, scales, mins, bits)


def group_forward(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ bias) with whichever kernel `pack` chose."""
    if isinstance(weight, group_q8.Q8GroupWeight):
        return group_q8.q8_linear(x, weight, bias)
    return tiled_gemm.group_linear(x, weight, bias)
