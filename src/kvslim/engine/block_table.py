"""The runner's persistent copy of the block tables, as one [rows, max_blocks] tensor.

Each running sequence owns a row for its whole life. Per step only the entries the block manager
changed (`Sequence.block_table_dirty_from` onwards) are copied, so building a step's tables costs
O(batch), not O(tokens in the cache)."""
from __future__ import annotations

import torch

from kvslim.engine.sequence import Sequence


class BlockTables:
    def __init__(self, num_rows: int, max_blocks_per_seq: int, device: torch.device):
        self.device = device
        self.table = torch.zeros(num_rows, max_blocks_per_seq, dtype=torch.long, device=device)
        self.row_of: dict[int, int] = {}
        self.free_rows = list(range(num_rows - 1, -1, -1))

    def release(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.free_rows.append(row)

    def rows_for(self, seqs: list[Sequence]) -> torch.Tensor:
        """Row index of each sequence, syncing the entries changed since the last step."""
        rows = []
        for seq in seqs:
            row = self.row_of.get(seq.seq_id)
            if row is None:
                row = self.row_of[seq.seq_id] = self._free_row()
                seq.block_table_dirty_from = 0
            start = seq.block_table_dirty_from
            if start < len(seq.block_table):
                self.table[row, start:len(seq.block_table)] = torch.tensor(
                    seq.block_table[start:], dtype=torch.long)
            seq.block_table_dirty_from = len(seq.block_table)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _free_row(self) -> int:
        if not self.free_rows:                # more live sequences than expected: grow
            old = self.table
            self.table = torch.zeros(2 * old.shape[0], old.shape[1], dtype=old.dtype,
                                     device=self.device)
            self.table[:old.shape[0]] = old
            self.free_rows = list(range(self.table.shape[0] - 1, old.shape[0] - 1, -1))
        return self.free_rows.pop()

    def slots(self, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """Cache slot (block id * block_size + offset) of each (row, position) pair."""
        return self.table[rows, positions // block_size] * block_size + positions % block_size
