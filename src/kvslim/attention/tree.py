"""`TreeRows`: a prefill chunk whose rows are a tree of drafted tokens, verified in one pass.

Row 0 is the root (the sequence's last token, not yet computed); every other row is a draft
whose parent is an earlier row. The rows occupy consecutive cache slots from the chunk's start,
but a row's position (its RoPE, its window) is start + its depth, and it attends to the keys
before the chunk plus its own ancestors (itself included), which is exactly the context a plain
decode of that path would have. Every backend reads the same two facts: each row's depth and its
ancestor bit mask (bit i: row i is on its path)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_TREE_ROWS = 64           # one bit per row in an int64 mask


@dataclass(frozen=True)
class TreeRows:
    parents: tuple[int, ...]                   # per row its parent row; -1 for row 0 only
    depths: tuple[int, ...] = field(init=False)
    bits: tuple[int, ...] = field(init=False)  # ancestors and the row itself, as int64 masks

    def __post_init__(self) -> None:
        parents = self.parents
        if not parents or parents[0] != -1 or len(parents) > MAX_TREE_ROWS or any(
                not 0 <= p < i for i, p in enumerate(parents) if i):
            raise ValueError(f"a tree of at most {MAX_TREE_ROWS} rows, row 0 its root and each "
                             f"parent an earlier row, got parents {list(parents)}")
        depths, bits = [0], [1]
        for i, p in enumerate(parents[1:], start=1):
            depths.append(depths[p] + 1)
            bits.append(bits[p] | 1 << i)
        # int64 masks: the 64th row's bit is the sign bit, read back the same by every backend
        bits = [b - (1 << 64) if b >= 1 << 63 else b for b in bits]
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "bits", tuple(bits))

    def __len__(self) -> int:
        return len(self.parents)

    def ancestors(self, device: torch.device) -> torch.Tensor:
        """[rows, rows] bool: row i may read row j (j on i's path)."""
        n = len(self)
        bits = torch.tensor(self.bits, dtype=torch.long, device=device)
        shifts = torch.arange(n, device=device)
        return (bits[:, None] >> shifts[None, :]) & 1 == 1
