"""Device selection shared by every entry point."""
from __future__ import annotations

import torch

from kvslim.errors import KvslimError


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' picks CUDA when present, else the CPU; an explicit CUDA request without CUDA fails."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise KvslimError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KvslimError(f"device {device!r} requested but CUDA is not available")
    return dev


def host_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host values (a list) on `device`, without a host synchronisation: a copy
    from pageable memory to CUDA waits for the stream to drain (the host stops until every
    kernel queued before has run), so the values go through pinned memory and an
    asynchronous copy instead; PyTorch's pinned allocator keeps the buffer alive until the
    copy is done."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
