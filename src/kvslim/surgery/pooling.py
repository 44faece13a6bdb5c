"""How one group of KV heads becomes one head, tensor by tensor: the calibration-free pooling
methods of `kvslim convert` (`convert.py`), which the per-layer sensitivity measurement
(`sensitivity.py`) applies too. `align` (`align.py`) rotates the heads into a common basis
before it pools them by the mean."""
from __future__ import annotations

import torch

from kvslim.errors import KvslimError

POOLING_METHODS = ("mean", "first", "random")


def pool_heads(weight: torch.Tensor, num_heads: int, kv_heads: int, method: str,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """weight [num_heads * d, ...] (rows of a k/v projection or its bias) -> [kv_heads * d, ...]."""
    per = num_heads // kv_heads
    heads = weight.reshape(kv_heads, per, -1, *weight.shape[1:])   # [K, per, d, ...]
    if method == "mean":
        pooled = heads.mean(dim=1)
    elif method == "first":
        pooled = heads[:, 0]
    elif method == "random":
        std = weight.float().std().item() if weight.dim() > 1 else 0.0
        pooled = torch.randn(heads[:, 0].shape, generator=generator) * std
    else:
        raise KvslimError(f"unknown --method {method!r}; choose one of "
                          f"{', '.join(POOLING_METHODS + ('align',))}")
    return pooled.reshape(-1, *weight.shape[1:]).to(weight.dtype)
