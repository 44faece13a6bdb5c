"""`torch.ops.kvslim.lora_add_(y, x, slots, a, b, shard_rows)`: many LoRA adapters in one batch
(Punica's SGMV), each row of x through the adapter of its slot and added into y, the base
layer's output, in place; a row whose slot is -1 is left as it was. a [S, n*R, in] stacks each
slot's A matrices of the layer's n output shards, b [S, out, R] each output row's coefficients
on its shard's rank vector, the scaling folded in (csrc/lora_sgmv.cpp).

Every dot product runs in one fixed order, so a row's numbers do not depend on the other rows,
their number or the threads: the engine's batch invariance holds with adapters mixed in a batch.
lora/layer.py's LoRALinear calls it once per fused linear, on the CPU in float32; elsewhere,
or without the extension, `lora_add_reference` (torch, any device and dtype)."""
from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from kvslim.kernels import extension

FAKES = {"lora_add_": lambda y, x, slots, a, b, shard_rows: None}

# Gathered adapter weights a fallback chunk may hold (elements): rows per chunk follow from it.
CHUNK_ELEMENTS = 1 << 24

# Resolved once, eagerly (when the adapters are loaded).
available = extension.ResolvedOnce(FAKES)


def usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and available()


def lora_add_(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
              b: torch.Tensor, shard_rows: Sequence[int]) -> None:
    """y [T, out] += each row's LoRA delta (see the module): the kernel where `usable`, else
    `lora_add_reference`."""
    if usable(x):
        torch.ops.kvslim.lora_add_(y, x, slots, a, b, list(shard_rows))
    else:
        lora_add_reference(y, x, slots, a, b, shard_rows)


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, shard_rows: Sequence[int]) -> None:
    """The op's meaning in torch, on any device and dtype, without a host sync: rows in chunks,
    each row's adapter gathered (slot -1 reads slot 0's), its A and B products batched, and the
    sum written back only where the slot is >= 0 (a row with -1 keeps its bits)."""
    rows, rank = x.shape[0], b.shape[2]
    if sum(shard_rows) != y.shape[1] or a.shape[1] != len(shard_rows) * rank:
        raise ValueError(f"lora_add_: shard_rows {list(shard_rows)} do not fit a "
                         f"{tuple(a.shape)} and b {tuple(b.shape)} for y {tuple(y.shape)}")
    chunk = max(1, CHUNK_ELEMENTS // (a.shape[1] * a.shape[2] + b.shape[1] * rank))
    ends = list(accumulate(shard_rows))
    for t0 in range(0, rows, chunk):
        s = slots[t0:t0 + chunk]
        ag, bg = a[s.clamp(min=0)], b[s.clamp(min=0)]
        u = torch.bmm(ag, x[t0:t0 + chunk, :, None].to(a.dtype)).view(len(s), -1, rank, 1)
        delta = torch.cat([torch.bmm(bg[:, o0:o1], u[:, j]) for j, (o0, o1) in
                           enumerate(zip([0, *ends[:-1]], ends))], dim=1).squeeze(-1)
        part = y[t0:t0 + chunk]
        part.copy_(torch.where((s >= 0)[:, None], part + delta.to(y.dtype), part))
