"""CUDA: the linears of a 2:4-pruned model (`kvslim prune --pattern 2:4`) as PyTorch's
semi-structured sparse tensors (`torch.sparse.to_sparse_semi_structured`: the kept half of the
values plus their positions, multiplied by cuSPARSELt or CUTLASS sparse tensor-core kernels).

Opt-in (`EngineConfig.cuda_sparse_24`, `--cuda-sparse-24`): the sparse kernels pay off on large
row counts (prefill) and may lose at decode's few rows, so whether to turn it on is read from
`benchmarks/cuda_decode_check.py --sparse24`, on the GPU in question. Once on, every 2:4 weight
runs the sparse kernel at every row count, so that a row's arithmetic does not depend on how
many rows share its step. A weight the sparse format cannot hold (not 2:4, a shape it refuses)
keeps its dense kernel."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvslim.errors import ConfigError

DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)          # sparse tensor cores: Ampere and later


def why_unusable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why semi-structured sparse linears cannot run on this model's device and dtype, or None."""
    if device.type != "cuda":
        return f"cuda_sparse_24 needs a CUDA device; the model is on {device.type}"
    if dtype not in DTYPES:
        return f"cuda_sparse_24 needs a float16 or bfloat16 model, got {str(dtype).split('.')[-1]}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"cuda_sparse_24 needs sparse tensor cores (compute capability 8.0 or later), "
                f"this GPU has {capability[0]}.{capability[1]}")
    return None


class Sparse24CudaKernel:
    """y = x W^T + b with W held as a semi-structured sparse tensor, its only copy."""
    weight_in_out = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 to_sparse: Callable[[torch.Tensor], torch.Tensor]):
        self.out_features = weight.shape[0]
        self.sparse = to_sparse(weight.detach())
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = F.linear(x.reshape(-1, x.shape[-1]), self.sparse, self.bias)
        return out.view(*lead, self.out_features)


def use_semi_structured_24(model: nn.Module, to_sparse: Callable | None = None) -> int:
    """Every float `Linear` of `model` whose weight is 2:4 runs a `Sparse24CudaKernel`; returns
    how many. `to_sparse` replaces torch's conversion (tests)."""
    from kvslim.layers.cpu_linear import is_two_of_four
    from kvslim.layers.linear import Linear
    param = next(model.parameters())
    if to_sparse is None:
        reason = why_unusable(param.device, param.dtype)
        if reason is not None:
            raise ConfigError(reason)
        to_sparse = torch.sparse.to_sparse_semi_structured
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    count = 0
    for module in model.modules():
        if not isinstance(module, Linear) or module.kernel is not None:
            continue
        if owners[id(module.weight)] > 1 or not is_two_of_four(module.weight):
            continue                               # a tied weight is read densely elsewhere
        try:
            module.kernel = Sparse24CudaKernel(module.weight, module.bias, to_sparse)
        except (RuntimeError, ValueError):         # a shape the sparse format refuses
            continue
        module.weight.data = module.weight.new_empty(0)
        count += 1
    return count
