"""`HiddenWindows`: the last hidden states of each sequence, kept for a proposer that drafts from
the model's own features (Medusa: the one that drew the latest token; EAGLE: a window of them).

A sequence's window holds the final hidden states of consecutive positions ending at `end`, the
position whose logits drew the sequence's latest token (num_tokens - 2 after a step); the token
each one drew is the sequence's token one position later. A step whose rows do not continue the
window (a prefix-cache hit skipped positions, a preempted sequence starts over) replaces it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HiddenWindow:
    end: int                       # position of the last row
    rows: torch.Tensor             # [n, hidden], positions end - n + 1 .. end

    @property
    def start(self) -> int:
        return self.end - self.rows.shape[0] + 1


class HiddenWindows:
    def __init__(self, size: int):
        self.size = size
        self.windows: dict[int, HiddenWindow] = {}

    def keep(self, seq_id: int, first_position: int, rows: torch.Tensor) -> None:
        """rows [n, hidden]: the hidden states of positions first_position.. of this step."""
        if rows.shape[0] == 0:
            return
        end = first_position + rows.shape[0] - 1
        old = self.windows.get(seq_id)
        if old is not None and old.end + 1 == first_position:
            rows = torch.cat([old.rows, rows])
        self.windows[seq_id] = HiddenWindow(end, rows[-self.size:].clone())

    def get(self, seq_id: int) -> HiddenWindow | None:
        return self.windows.get(seq_id)

    def pop(self, seq_id: int) -> None:
        self.windows.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.windows
