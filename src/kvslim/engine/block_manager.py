"""`BlockManager`: which KV-cache blocks each sequence owns. Plain Python, no torch.

- Reference counts let sequences share blocks (prefix-cache hits, n > 1 forks).
- Prefix caching: a full, computed block is entered under its chained digest (Sequence.hash_blocks);
  a hit is still confirmed token by token, block after block, so even a forced sha256
  collision can never serve wrong K/V.
- Freed blocks keep their contents and stay findable until reused. The free queue is in eviction
  order (least recently freed first; a sequence's tail blocks before its prefix).
- Copy-on-write: a sequence about to write into a block it shares gets a private copy; the copy
  itself is tensor work, returned as (src, dst) pairs for the model runner.
- KV-cache groups (`kv_cache/groups.py`): a sequence holds one block table per group. A group
  with a window releases the blocks its next query can no longer see (`release_out_of_window`)
  and allocates a prompt chunk by chunk, so its blocks stay bounded however long the context;
  a prefix-cache hit for it needs only the cached blocks inside the window of the hit's end. A
  window group with attention sinks (kv_cache/window.py) also keeps its first `sinks` blocks.
- Demotion (`--kv-pressure demote`, engine/kv_demotion.py): a full pool quantizes old blocks
  to int8 in place, four to a block, before the scheduler preempts anyone."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvslim.engine.sequence import Sequence
from kvslim.kv_cache.groups import NULL_BLOCK, first_needed_block
from kvslim.kv_cache.window import sink_blocks


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: tuple[int, bytes] | None = None      # prefix-cache key: (group, digest)
    token_ids: tuple[int, ...] | None = None
    pool: int = 0                              # its precision's pool (a per-layer KV plan)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark_blocks: int = 0, group_windows: tuple[int | None, ...] = (None,),
                 group_sinks: tuple[int, ...] | None = None, float_tail_blocks: int = 0,
                 offload=None, pools: tuple[tuple[int, int], ...] | None = None,
                 group_pool: tuple[int, ...] | None = None, demote: bool = False):
        """group_windows: per KV-cache group, its window (None: it keeps every block);
        group_sinks: per group, the first positions a window group keeps;
        float_tail_blocks: a packed cache's residual (attention/lowbit_cache.py): a sequence's
        last blocks, whose K/V live in its own recent rows. A fork computes them again. With
        full blocks in it, a prefix-cache hit could not be exact (the query after the hit would
        read the block before it from the pool, a recomputed one from its recent rows), so
        prefix caching is off.
        offload: a second tier for full prefix blocks (engine/kv_offload.py's BlockOffload):
        evicted blocks go there (or as they fill, write-through), a prompt's blocks that miss
        the pool are looked for there. One KV-cache group only. pools: a per-layer KV plan's
        (kv_cache/plan.py's KVPool): per precision (first block id, blocks); group_pool: each
        group's pool, whose ids alone its tables hold. Default: one pool of every block.
        demote: blocks may be demoted to int8 (`demote`; one pool)."""
        self.float_tail_blocks = float_tail_blocks
        self._older = max(0, float_tail_blocks - 1)     # full blocks kept in float16
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching and not self._older
        self.watermark_blocks = watermark_blocks
        self.group_windows = tuple(group_windows)
        self.group_sink_blocks = tuple(sink_blocks(s, block_size)
                                       for s in group_sinks or (0,) * len(self.group_windows))
        self.pool_ranges = pools or ((0, num_blocks),)
        self.group_pool = group_pool or (0,) * len(self.group_windows)
        self.blocks = [Block(i, pool=p) for p, (first, n) in enumerate(self.pool_ranges)
                       for i in range(first, first + n)]
        # Per pool, its free blocks in eviction order.
        self.free_queues: list[OrderedDict[int, None]] = [
            OrderedDict.fromkeys(range(first, first + n)) for first, n in self.pool_ranges]
        self.cached: dict[tuple[int, bytes], int] = {}   # (group, block digest) -> block id
        self.num_cached_free_blocks = 0          # free blocks whose contents are still findable
        self.prefix_cache_queries = 0            # prompt tokens looked up at admission
        self.prefix_cache_hits = 0               # of those, served from the cache
        self.offload = offload
        if demote:
            from kvslim.engine.kv_demotion import BlockDemotion    # not on `import kvslim`'s path
        self.demotion = BlockDemotion() if demote else None

    # ---- counters ------------------------------------------------------------------------
    @property
    def free_queue(self) -> OrderedDict[int, None]:
        """The free blocks in eviction order (pool after pool)."""
        return OrderedDict((b, None) for q in self.free_queues for b in q)

    @property
    def num_free_blocks(self) -> int:
        return sum(map(len, self.free_queues))

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def _fits(self, needed_by_group: list[int], reserve: int = 0) -> bool:
        """Whether each pool has its groups' blocks, and its share of `reserve`, free."""
        needed = [0] * len(self.free_queues)
        for g, n in enumerate(needed_by_group):
            needed[self.group_pool[g]] += n
        return all(n + -(-reserve * count // self.num_blocks) <= len(q)
                   for n, q, (_, count) in zip(needed, self.free_queues, self.pool_ranges))

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def blocks_held(self, seq: Sequence) -> list[int]:
        """Per group, the blocks the sequence holds (released window entries not counted)."""
        return [sum(b != NULL_BLOCK for b in table) for table in seq.block_tables]

    # ---- hashing and lookup --------------------------------------------------------------
    def _cached_block(self, seq: Sequence, group: int, i: int) -> int | None:
        """The cached block holding the sequence's block i for `group`, confirmed token by token."""
        block_id = self.cached.get((group, seq.block_hashes[i]))
        if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(i)):
            return None
        return block_id

    def _lookup(self, seq: Sequence) -> tuple[int, list[list[int]]]:
        """The longest cached prefix, in whole blocks, that every group can serve, and per group
        its table of the prefix: every block for a full group; for a window group, its sink
        blocks and those inside the window of the prefix's end (NULL_BLOCK between). The last
        token is never served from the cache: its logits are needed, so it must be computed."""
        none = [[] for _ in self.group_windows]
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return 0, none              # prompt logprobs need the logits of every prompt token
        max_blocks = (seq.num_tokens - 1) // self.block_size
        seq.hash_blocks(max_blocks)
        leading = {}
        for g, window in enumerate(self.group_windows):
            if window is None:
                leading[g] = self._leading_hits(seq, g, max_blocks)
                max_blocks = min(max_blocks, len(leading[g]))
        for h in range(max_blocks, 0, -1):
            hits = [leading[g][:h] if g in leading else self._window_hits(seq, g, h)
                    for g in range(self.num_groups)]
            if all(hit is not None for hit in hits):
                return h, hits
        return 0, none

    def _leading_hits(self, seq: Sequence, group: int, limit: int) -> list[int]:
        hits = []
        for i in range(limit):
            block_id = self._cached_block(seq, group, i)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _window_hits(self, seq: Sequence, group: int, h: int) -> list[int] | None:
        """A window group's table of a hit of `h` blocks: the cached blocks the first computed
        token can see (its sinks' and its window's), NULL_BLOCK for the others; None when one
        it needs is gone."""
        first = first_needed_block(h * self.block_size, self.group_windows[group], self.block_size)
        keep = min(self.group_sink_blocks[group], first)
        hits = [self._cached_block(seq, group, i) if i < keep or i >= first else NULL_BLOCK
                for i in range(h)]
        return None if None in hits else hits

    # ---- allocation ----------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _admission_blocks(self, seq: Sequence, group: int, computed: int,
                          num_new_tokens: int | None) -> int:
        """Table length a group gets at admission: every token for a full group; for a window
        group only the first chunk (`num_new_tokens` after the cached prefix)."""
        if self.group_windows[group] is None or num_new_tokens is None:
            return self._blocks_for(seq.num_tokens)
        return self._blocks_for(min(seq.num_tokens, computed + num_new_tokens))

    def can_allocate(self, seq: Sequence, keep_watermark: bool = True,
                     num_new_tokens: int | None = None) -> bool:
        """Room for the sequence's tokens (a window group: its first `num_new_tokens`), leaving
        `watermark_blocks` free for the running sequences' next tokens (so that admission does
        not cause a preemption)."""
        return self._fits(*self._admission_needs(seq, keep_watermark, num_new_tokens))

    def allocation_shortfall(self, seq: Sequence, keep_watermark: bool = True,
                             num_new_tokens: int | None = None) -> int:
        """Blocks `can_allocate` lacks (one pool: what demotion runs with)."""
        needed, reserve = self._admission_needs(seq, keep_watermark, num_new_tokens)
        return sum(needed) + reserve - self.num_free_blocks

    def _admission_needs(self, seq: Sequence, keep_watermark: bool,
                         num_new_tokens: int | None) -> tuple[list[int], int]:
        h, hits = self._lookup(seq)
        computed = h * self.block_size
        needed = [self._admission_blocks(seq, g, computed, num_new_tokens) - h
                  + sum(1 for b in hit if b != NULL_BLOCK and self.blocks[b].ref_count == 0)
                  for g, hit in enumerate(hits)]
        return needed, self.watermark_blocks if keep_watermark else 0

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> None:
        """Blocks for a waiting sequence's tokens (see `can_allocate`); prefix-cache hits count
        as computed."""
        assert not any(seq.block_tables), "sequence already holds blocks"
        h, hits = self._lookup(seq)
        computed = h * self.block_size
        for block_id in (b for hit in hits for b in hit if b != NULL_BLOCK):
            self._take(block_id)    # all hits before any new block: a new one may evict a hit
        tables = []
        for g, hit in enumerate(hits):
            new = self._admission_blocks(seq, g, computed, num_new_tokens) - h
            tables.append(hit + [self._allocate_new(g) for _ in range(new)])
        seq.block_tables = tables
        loaded = self._load_offloaded(seq, tables[0], h) if self.offload is not None \
            and self.enable_prefix_caching and not seq.needs_prompt_logprobs else 0
        computed += loaded * self.block_size
        seq.dirty_from = [0] * self.num_groups
        seq.num_computed_tokens = seq.num_cached_tokens = computed
        seq.registered_blocks = [h + loaded] * self.num_groups
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_cached_tokens

    def _load_offloaded(self, seq: Sequence, table: list[int], h: int) -> int:
        """Fill the new blocks after the pool's `h` hits from the tier while it has them (never
        the block of the last prompt token, whose logits are needed); each loaded block enters
        the prefix cache. Returns how many were loaded."""
        limit = (seq.num_tokens - 1) // self.block_size
        seq.hash_blocks(limit)
        loaded = 0
        for i in range(h, limit):
            key, tokens = (0, seq.block_hashes[i]), tuple(seq.block_tokens(i))
            if key in self.cached or not self.offload.load(table[i], key, tokens):
                break
            block = self.blocks[table[i]]
            block.hash, block.token_ids = key, tokens
            self.cached[key] = table[i]
            loaded += 1
        return loaded

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queues[block.pool][block_id]
            self.num_cached_free_blocks -= block.hash is not None
        block.ref_count += 1

    def _allocate_new(self, group: int = 0) -> int:
        block_id, _ = self.free_queues[self.group_pool[group]].popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:                      # evict its cached contents
            if self.offload is not None:
                self.offload.save(block_id, block.hash, block.token_ids)
            self.num_cached_free_blocks -= 1
            self.forget(block_id)
        block.ref_count = 1
        return block_id

    # ---- growth and copy-on-write --------------------------------------------------------
    def _needs_copy(self, seq: Sequence, group: int) -> bool:
        """The next token lands in a partly filled block that someone else also holds."""
        pos = seq.num_computed_tokens
        idx = pos // self.block_size
        table = seq.block_tables[group]
        return (pos % self.block_size != 0 and idx < len(table) and table[idx] != NULL_BLOCK
                and self.blocks[table[idx]].ref_count > 1)

    def _new_blocks_needed(self, seq: Sequence, group: int, num_new_tokens: int) -> int:
        total = self._blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_tables[group]))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._fits([self._new_blocks_needed(seq, g, num_new_tokens)
                           + self._needs_copy(seq, g) for g in range(self.num_groups)])

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for the next `num_new_tokens` tokens; returns block copies to perform."""
        copies = []
        for g, table in enumerate(seq.block_tables):
            if self._needs_copy(seq, g):
                idx = seq.num_computed_tokens // self.block_size
                src = table[idx]
                dst = self._allocate_new(g)
                self.blocks[src].ref_count -= 1
                table[idx] = dst
                seq.dirty_from[g] = min(seq.dirty_from[g], idx)
                copies.append((src, dst))
            needed = self._new_blocks_needed(seq, g, num_new_tokens)
            if needed:
                seq.dirty_from[g] = min(seq.dirty_from[g], len(table))
                table.extend(self._allocate_new(g) for _ in range(needed))
        return copies

    def take_changes(self, seq: Sequence) -> list[int]:
        """Per group, the first table entry changed since the last call (what a runner's copy
        of the table must take again); the marks start over."""
        changes, seq.dirty_from = seq.dirty_from, [len(t) for t in seq.block_tables]
        return changes

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_tables = [list(table) for table in parent.block_tables]
        child.dirty_from = [0] * self.num_groups
        for block_id in (b for table in child.block_tables for b in table):
            if block_id < NULL_BLOCK:
                self.demotion.ref(block_id)
            elif block_id != NULL_BLOCK:
                self.blocks[block_id].ref_count += 1
        if self.float_tail_blocks and (child.num_computed_tokens % self.block_size
                                       or self._older):
            # with full blocks in the residual, their recomputation would need the ones
            # before in float16 too: the child starts over
            full = 0 if self._older else child.num_computed_tokens // self.block_size
            self.trim(child, full * self.block_size)
            child.num_computed_tokens = full * self.block_size
            child.registered_blocks = [min(r, full) for r in child.registered_blocks]

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens (slots reserved for speculative
        tokens that were rejected). Their contents were never entered in the prefix cache."""
        keep = self._blocks_for(num_tokens)
        for table in seq.block_tables:
            self.release(table[keep:])
            del table[keep:]

    def release(self, block_ids: list[int], tail_first: bool = True) -> None:
        """Drop one reference to each block (released window entries skipped), by default last
        first (tails are evicted before prefixes)."""
        for block_id in (reversed(block_ids) if tail_first else block_ids):
            if block_id < NULL_BLOCK:                   # a demoted block: maybe its page
                block_id = self.demotion.release(block_id)
            if block_id is None or block_id == NULL_BLOCK:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queues[block.pool][block_id] = None
                self.num_cached_free_blocks += block.hash is not None

    # ---- release and caching -------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Tail blocks are queued for eviction first, so that
        shared prefixes survive longest."""
        for table in seq.block_tables:
            self.release(table)
        seq.block_tables = [[] for _ in self.group_windows]
        seq.dirty_from = [0] * self.num_groups
        seq.registered_blocks = [0] * self.num_groups

    def release_out_of_window(self, seq: Sequence) -> None:
        """Window groups: release the blocks the next query can no longer see, oldest first
        (the runner's copy of the table keeps their stale ids: attention masks them out)."""
        for g, window in enumerate(self.group_windows):
            if window is None:
                continue
            table = seq.block_tables[g]
            first = min(first_needed_block(seq.num_computed_tokens, window, self.block_size),
                        len(table))
            keep = self.group_sink_blocks[g]
            start = first
            while start > keep and table[start - 1] != NULL_BLOCK:
                start -= 1
            self.release(table[start:first], tail_first=False)
            table[start:first] = [NULL_BLOCK] * (first - start)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's newly completed full blocks into the prefix cache, per group."""
        if not self.enable_prefix_caching:
            return
        for g, table in enumerate(seq.block_tables):
            full = min(seq.num_computed_tokens // self.block_size, len(table))
            if full <= seq.registered_blocks[g]:
                continue
            seq.hash_blocks(full)
            for i in range(seq.registered_blocks[g], full):
                if table[i] < 0:                        # released, or demoted
                    continue
                block, key = self.blocks[table[i]], (g, seq.block_hashes[i])
                if block.hash is None and key not in self.cached:
                    block.hash, block.token_ids = key, tuple(seq.block_tokens(i))
                    self.cached[key] = block.block_id
                    if self.offload is not None and self.offload.write_through:
                        self.offload.save(block.block_id, key, block.token_ids)
            seq.registered_blocks[g] = full

    # ---- demotion (engine/kv_demotion.py) --------------------------------------------------
    def demote(self, seqs: list[Sequence]) -> bool:
        """Demote one block of the first of `seqs` that has one to demote (`BlockDemotion.
        demote_one`); False when none has, or demotion is off."""
        return self.demotion is not None and self.demotion.demote_one(self, seqs)

    def forget(self, block_id: int) -> None:
        """Take a block out of the prefix cache (its bytes are about to change)."""
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash = block.token_ids = None

    def reset_prefix_cache(self) -> None:
        for block_id in (b for q in self.free_queues for b in q):
            self.blocks[block_id].hash = self.blocks[block_id].token_ids = None
        self.num_cached_free_blocks = 0
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].hash == h}
