"""CPU inference: the linear kernel on oneDNN with weights prepacked once.

torch's default CPU linear goes through the BLAS library, whose small-batch GEMMs are slow on
some CPUs (on the AMD EPYC of our benchmarks a batch-8 decode step took twice its batch-1 time).
oneDNN's JIT kernels with a weight reordered ahead of time for small batches read the weights
at close to memory bandwidth, which is what a memory-bound decode step needs.

A single row (a batch-1 decode step) is the exception: there a plain GEMV over the weight stored
input-major ([in, out], contiguous) streams it fastest. On the Xeon of our benchmarks it reads
25 GB/s against 18 GB/s for the packed kernel; at 2 rows they are even and from 8 rows on the
packed kernel wins by 20-30%. So each layer keeps both forms, twice the weight memory, when
the model's weights take at most a quarter of this machine's memory; a larger model keeps the
packed form only.

Both switch arithmetic with the number of rows (GEMV at one, oneDNN's blocked GEMM from two), so
a row's logits depend on how many rows share its step. Where kvslim's own extension builds,
float32 layers run its tiled GEMM instead (`TiledCpuKernel`, kernels/tiled_gemm.py: each output
one chain of multiply-adds in input order, at every M), one copy of the weight. Measured on the
2-core Xeon of docs/benchmarks.md (SmolLM2-135M's shapes, 2 threads, median µs; oneDNN column:
GEMV at M = 1, packed from 2), tiled / oneDNN:

    M                 1            2            8            64
    qkv  576->960     17 / 18      20 / 36      46 / 56      276 / 277
    gate_up ->3072    139 / 122    138 / 179    175 / 224    882 / 777
    down 1536->576    44 / 34      44 / 69      80 / 102     461 / 439
    lm_head ->49152   2294 / 2611  2766 / 3963  5372 / 5140  17228 / 14964

within 15% where it loses (M = 64, one row of the MLP), faster at 2-8 rows: batch invariance
costs nothing a decode step would see.

A weight with at most two nonzeros in every four consecutive inputs (a model pruned 2:4, `kvslim
prune --pattern 2:4`) runs kvslim's 2:4 kernel instead (`Sparse24CpuKernel`, kernels/sparse24.py:
the kept values and their 2-bit positions, 53% of the float32 bytes, one chain of multiply-adds
per output at every M). Measured against the tiled kernel with the weights streamed from memory
(`python benchmarks/sparse_kernel.py --threads 1`, docs/pruning_kernel.json; 1 thread, the
second core busy): 0.54-0.81x its time at M = 1 on SmolLM2-135M's and larger shapes (0.66x over
a whole decode step's linears), 0.72-1.01x at M = 4, 0.60-0.72x at M = 16.

Float32 only; on any other device or dtype, or where the ops are missing, layers keep F.linear.
`kvslim.layers.linear.Linear` chooses its kernel with the rules here once its weights are loaded."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.kernels import tiled_gemm

BATCH_HINT = 64          # the reorder is tuned for this many rows; any number of rows works
GEMV_COPY_MAX_SHARE = 0.25   # of physical memory that the weights may take for the second form


def packed_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedCpuKernel:
    """y = x W^T + b from the oneDNN-packed weight, or from the input-major copy for one row.
    The packed tensor is opaque (it cannot be read back), so it holds the weights for good."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemv_copy: bool = True):
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                         BATCH_HINT)
        self.weight_in_out = weight.detach().t().contiguous() if gemv_copy else None
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 1 and self.weight_in_out is not None:
            out = (torch.mm(rows, self.weight_in_out) if self.bias is None
                   else torch.addmm(self.bias, rows, self.weight_in_out))
        elif torch.compiler.is_compiling():
            out = onednn_linear(rows, self.packed_weight, self.bias, self.out_features)
        else:
            out = _linear_pointwise(rows, self.packed_weight, self.bias)
        return out.view(*lead, self.out_features)


class TiledCpuKernel:
    """y = x W^T + b through kvslim's float32 tiled GEMM: the same arithmetic for every row
    count. Holds the only copy of the weight, in the kernel's tiles."""
    weight_in_out = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.out_features, self.in_features = weight.shape
        self.tiled = tiled_gemm.pack_float_weight(weight)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_gemm.float_linear(x, self.tiled, self.bias)


class Sparse24CpuKernel:
    """y = x W^T + b through kvslim's 2:4 kernel, for a weight with at most two nonzeros in
    every four consecutive inputs: the same arithmetic for every row count. Holds the only copy
    of the weight, its kept values and their positions."""
    weight_in_out = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        from kvslim.kernels import sparse24         # loaded with the first 2:4 sparse model
        self.kernel = sparse24
        self.out_features, self.in_features = weight.shape
        self.sparse = sparse24.pack_sparse24_weight(weight)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.sparse24_linear(x, self.sparse, self.bias)


def is_two_of_four(weight: torch.Tensor) -> bool:
    """Whether every four consecutive inputs of every row hold at most two nonzeros."""
    from kvslim.kernels import sparse24
    out, k = weight.shape
    return (k % sparse24.GROUP == 0 and bool(
        ((weight.view(out, k // sparse24.GROUP, sparse24.GROUP) != 0).sum(-1)
         <= sparse24.KEPT).all()))


def _linear_pointwise(rows: torch.Tensor, packed_weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")


# Inside a compiled decode step (engine/cpu_compile.py) the packed kernel is an opaque call:
# Inductor lowers mkldnn's op only for weights it packed itself. Eager calls skip the wrapper,
# whose dispatch would cost more than the small kernels of a decode step.
@torch.library.custom_op("kvslim::onednn_linear", mutates_args=())
def onednn_linear(rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    return _linear_pointwise(rows, packed_weight, bias)


@onednn_linear.register_fake
def _(rows, packed_weight, bias, out_features):
    return rows.new_empty(rows.shape[0], out_features)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


@torch.no_grad()
def packed_kernel_usable(model: nn.Module) -> bool:
    """Whether `model` (float32, on the CPU) can run a CPU kernel: kvslim's tiled one is
    built, or oneDNN's op exists and, checked on a random input, computes F.linear."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return False
    if tiled_gemm.available():
        return True
    if not packed_linear_available():
        return False
    weight, bias, x = torch.randn(48, 64), torch.randn(48), torch.randn(3, 64)
    try:
        return torch.allclose(PackedCpuKernel(weight, bias)(x), F.linear(x, weight, bias),
                              atol=1e-4, rtol=1e-4)
    except RuntimeError:
        return False


def gemv_copy_fits(model: nn.Module) -> bool:
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return weight_bytes <= GEMV_COPY_MAX_SHARE * _physical_memory()
