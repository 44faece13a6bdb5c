"""`BlockDemotion`: under `--kv-pressure demote`, a full pool sheds bytes before it sheds work.
Plain Python, no torch (the block manager's side; the bytes move in engine/kv_storage.py).

A float32 block's bytes hold four int8 blocks of its shape (kernels/paged_attention.py's
`demoted_view`): a *page*. Demoting a block quantizes it into a free quarter of a page and
frees its float32 block; when no page has a quarter free, the block's own bytes become one,
so four demotions free three blocks, and a pool that is full can still demote. A sequence's
table then names the int8 block as `-2 - id` (`demoted_entry`), which the decode kernel reads
in place. A demoted block never goes back up, and never serves the prefix cache (its float32
original stays findable in the free queue until that block is reused).

Which blocks (`BlockManager.demote`): full blocks of the sequences that have run longest
first, each sequence's oldest first over its KV-cache groups (the context furthest from the
tokens it still has to write); never a block another sequence also holds, so a sequence that demotion did not touch
reads exactly what it read alone, and never one still being written. Under pressure the
scheduler demotes until the step fits, and preempts only when nothing is left to demote."""
from __future__ import annotations

from collections import OrderedDict

from kvslim.errors import KvslimError
from kvslim.kv_cache.plan import DEMOTED_PER_BLOCK as QUARTERS


def check_demotion(backend: str, float32_cache: bool, latent: bool) -> None:
    """What the runner must have for demotion (EngineConfig checks the options), or a
    one-line error."""
    if backend != "kernel" or not float32_cache or latent:
        raise KvslimError("kv_pressure=demote runs on kvslim's CPU decode kernel over a float32 "
                          "cache: a float32 model on the CPU, attention_backend auto or "
                          "kernel, no MLA")


def demoted_entry(int8_block: int) -> int:
    """The table entry of int8 block `int8_block` (below NULL_BLOCK = -1)."""
    return -2 - int8_block


def int8_block(entry: int) -> int:
    return -2 - entry


class BlockDemotion:
    def __init__(self):
        self.pages: dict[int, list[int]] = {}     # float32 block -> each quarter's references
        self.open: OrderedDict[int, None] = OrderedDict()   # int8 blocks free in a page
        self.num_demoted = 0                      # blocks demoted since start
        self.copies: list[tuple[int, int]] = []   # (float32 block, int8 block), for the runner

    def demote_one(self, bm, seqs) -> bool:
        """Demote the oldest block (`oldest`) of the first of `seqs` that has one, in the
        block manager `bm`; False when none has. Its copy waits in `copies` (`take_copies`)."""
        for seq in seqs:
            found = self.oldest(seq, bm.blocks, bm.block_size)
            if found is None:
                continue
            g, i = found
            src, dst = seq.block_tables[g][i], self.take()
            if dst is None:                 # no quarter free: the block's bytes become a page
                bm.forget(src)
                dst = self.open_page(src)
            else:
                bm.release([src])           # its float32 original stays findable till reused
            seq.block_tables[g][i] = demoted_entry(dst)
            seq.dirty_from[g] = min(seq.dirty_from[g], i)
            self.copies.append((src, dst))
            return True
        return False

    def take_copies(self) -> list[tuple[int, int]]:
        """The demotions since the last call, in order: the runner quantizes each float32
        block into its int8 block, reading every source before writing any (a page may be
        one of them)."""
        copies, self.copies = self.copies, []
        return copies

    def room(self, bm, seqs) -> int:
        """Blocks demoting every block `demote_one` could take from `seqs` would free: one
        each into a free quarter, three of every four after that (the fourth is a page)."""
        n = sum(1 for seq in seqs for table in seq.block_tables
                for b in table[:seq.num_computed_tokens // bm.block_size]
                if b >= 0 and bm.blocks[b].ref_count == 1)
        into_open = min(n, len(self.open))
        rest = n - into_open
        return into_open + rest - -(-rest // QUARTERS)

    @staticmethod
    def oldest(seq, blocks, block_size: int) -> tuple[int, int] | None:
        """(KV-cache group, table index) of the sequence's oldest full block, over its
        groups, that is neither demoted, released nor held by another sequence (`blocks`: the
        block manager's), or None."""
        for i in range(seq.num_computed_tokens // block_size):
            for g, table in enumerate(seq.block_tables):
                if i < len(table) and table[i] >= 0 and blocks[table[i]].ref_count == 1:
                    return g, i
        return None

    def take(self) -> int | None:
        """A free int8 block in some page (one reference), or None when every page is full:
        the block a demotion goes to."""
        if not self.open:
            return None
        block, _ = self.open.popitem(last=False)
        self.pages[block // QUARTERS][block % QUARTERS] = 1
        self.num_demoted += 1
        return block

    def open_page(self, block_id: int) -> int:
        """The float32 block `block_id` (the block manager keeps it taken) becomes a page;
        returns its first quarter, taken."""
        self.pages[block_id] = [0] * QUARTERS
        for q in range(QUARTERS):
            self.open[block_id * QUARTERS + q] = None
        return self.take()

    def ref(self, entry: int) -> None:
        block = int8_block(entry)
        self.pages[block // QUARTERS][block % QUARTERS] += 1

    def release(self, entry: int) -> int | None:
        """Drop one reference to the int8 block a table entry names. Returns the float32
        block of its page when the page has nothing left in it (the caller frees it)."""
        block = int8_block(entry)
        page = block // QUARTERS
        refs = self.pages[page]
        refs[block % QUARTERS] -= 1
        assert refs[block % QUARTERS] >= 0, f"int8 block {block} freed twice"
        if refs[block % QUARTERS]:
            return None
        if any(refs):
            self.open[block] = None
            return None
        del self.pages[page]
        for q in range(QUARTERS):
            self.open.pop(page * QUARTERS + q, None)
        return page
