"""CPU inference: linear layers on oneDNN with weights prepacked once.

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

Float32 only; on any other device or dtype, or where the op is missing, the model is left as
it is."""
from __future__ import annotations

import os

import torch
from torch import nn

BATCH_HINT = 64          # the reorder is tuned for this many rows; any number of rows works
GEMV_COPY_MAX_SHARE = 0.25   # of physical memory that the weights may take for the second form


def packed_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, gemv_copy: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("weight_in_out", linear.weight.detach().t().contiguous()
                             if gemv_copy else None, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 1 and self.weight_in_out is not None:
            out = (torch.mm(rows, self.weight_in_out) if self.bias is None
                   else torch.addmm(self.bias, rows, self.weight_in_out))
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias,
                                                     "none", [], "")
        return out.view(*lead, self.out_features)


def _swap(module: nn.Module, gemv_copy: bool) -> None:
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child, gemv_copy))
        else:
            _swap(child, gemv_copy)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


@torch.no_grad()
def pack_linears_for_cpu(model: nn.Module) -> bool:
    """Swap every nn.Linear of a float32 CPU model for a PackedLinear, after checking on a
    random input that the packed kernel computes the same thing. Returns whether it swapped."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32 or not packed_linear_available():
        return False
    probe = nn.Linear(64, 48)
    x = torch.randn(3, 64)
    try:
        if not torch.allclose(PackedLinear(probe)(x), probe(x), atol=1e-4, rtol=1e-4):
            return False
    except RuntimeError:
        return False
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    _swap(model, weight_bytes <= GEMV_COPY_MAX_SHARE * _physical_memory())
    return True
