"""The runner's persistent copy of the block tables: per KV-cache group, one [rows, max_blocks]
tensor (`table[group]`). A running sequence owns the same row in every group for its whole life.

Per step only the entries the block manager changed (a scheduled entry's `table_changes`
onwards, per group) are copied, so building a step's tables costs O(batch), not O(tokens in the cache). Entries a
window group released keep their stale ids here (or 0 where a sequence never held a block):
attention masks those positions, so they are never read into a result."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvslim.device import host_tensor
from kvslim.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvslim.engine.scheduler import ScheduledSequence


class BlockTables:
    def __init__(self, num_rows: int, max_blocks_per_seq: int, device: torch.device,
                 num_groups: int = 1, group_first_block: list[int] | None = None):
        """group_first_block: per group, the first block id of its pool (a per-layer KV plan's
        pools each have storage of their own, indexed from 0)."""
        self.device = device
        self.group_first_block = group_first_block or [0] * num_groups
        self.table = torch.zeros(num_groups, num_rows, max_blocks_per_seq, dtype=torch.long,
                                 device=device)
        self.row_of: dict[int, int] = {}
        self.free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def max_blocks(self) -> int:
        return self.table.shape[2]

    def release(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.free_rows.append(row)

    def rows_for(self, entries: list[ScheduledSequence]) -> list[int]:
        """Row index of each scheduled sequence, syncing the entries its `table_changes` name
        (all of them for a sequence new to the runner): all in one copy to the device, which
        does not wait for it (`host_tensor`). The runner never writes the Sequence."""
        rows, updates = [], ([], [], [], [])        # group, row, column, block id
        for entry in entries:
            seq = entry.seq
            row = self.row_of.get(seq.seq_id)
            changes = entry.table_changes
            if row is None or changes is None:
                changes = [0] * len(seq.block_tables)
            if row is None:
                row = self.row_of[seq.seq_id] = self._free_row()
            for g, table in enumerate(seq.block_tables):
                start = changes[g]
                n = len(table) - start
                if n > 0:
                    updates[0].extend([g] * n)
                    updates[1].extend([row] * n)
                    updates[2].extend(range(start, len(table)))
                    # A released entry (-1) becomes 0: a valid id whose contents are masked;
                    # a demoted one (below -1, engine/kv_demotion.py) the kernel reads as is.
                    first = self.group_first_block[g]
                    updates[3].extend(b - first if b >= 0 else b if b < -1 else 0
                                      for b in table[start:])
            rows.append(row)
        if updates[0]:
            g, r, c, ids = host_tensor(list(updates), torch.long, self.device)
            self.table[g, r, c] = ids
        return rows

    def rows_of(self, seqs: list[Sequence]) -> list[int]:
        """The rows of sequences this step already synced."""
        return [self.row_of[seq.seq_id] for seq in seqs]

    def _free_row(self) -> int:
        if not self.free_rows:                # more live sequences than expected: grow
            old = self.table
            groups, num_rows, width = old.shape
            self.table = torch.zeros(groups, 2 * num_rows, width, dtype=old.dtype,
                                     device=self.device)
            self.table[:, :num_rows] = old
            self.free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self.free_rows.pop()

    def slots(self, group: int, rows: torch.Tensor, positions: torch.Tensor,
              block_size: int) -> torch.Tensor:
        """Cache slot (block id * block_size + offset) of each (row, position) pair in `group`."""
        return (self.table[group, rows, positions // block_size] * block_size
                + positions % block_size)
