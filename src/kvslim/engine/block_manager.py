"""`BlockManager`: which KV-cache blocks each sequence owns. Plain Python, no torch.

- Reference counts let sequences share blocks (prefix-cache hits, n > 1 forks).
- Prefix caching: a full, computed block is entered under a chained digest (sha256 of its
  parent's digest and its token ids), so equal digests mean equal prefixes unless sha256 itself
  collides; a hit is still confirmed token by token, block after block from the first, so even a
  forced collision can never serve wrong K/V.
- Freed blocks keep their contents and stay findable until reused. The free queue is in eviction
  order (least recently freed first; a sequence's tail blocks before its prefix).
- Copy-on-write: a sequence about to write into a block it shares gets a private copy; the copy
  itself is tensor work, returned as (src, dst) pairs for the model runner."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kvslim.engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """The prefix-cache key of a full block: sha256 over the parent block's key and the block's
    token ids (as int64). Token ids are all that determines K/V today; anything else that does
    (adapters, images, a per-tenant salt) must go into this digest too."""
    digest = hashlib.sha256(parent or b"\0" * 32)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark_blocks: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}       # block digest -> block id
        self.num_cached_free_blocks = 0          # free blocks whose contents are still findable
        self.prefix_cache_queries = 0            # prompt tokens looked up at admission
        self.prefix_cache_hits = 0               # of those, served from the cache

    # ---- counters ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    # ---- hashing -------------------------------------------------------------------------
    def _update_hashes(self, seq: Sequence, num_blocks: int) -> None:
        """Extend seq.block_hashes to its first `num_blocks` full blocks (incremental)."""
        for i in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(block_hash(parent, seq.block_tokens(i)))

    def _lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks. The last token is never
        served from the cache: its logits are needed, so it must be computed."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []                   # prompt logprobs need the logits of every prompt token
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._update_hashes(seq, max_blocks)
        hits = []
        for i in range(max_blocks):
            block_id = self.cached.get(seq.block_hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(i)):
                break
            hits.append(block_id)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, keep_watermark: bool = True) -> bool:
        """Room for all of the sequence's tokens, leaving `watermark_blocks` free for the
        running sequences' next tokens (so that admission does not cause a preemption)."""
        hits = self._lookup(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self._blocks_for(seq.num_tokens) - len(hits)
        reserve = self.watermark_blocks if keep_watermark else 0
        return needed + revived + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of a waiting sequence's tokens; prefix-cache hits count as computed."""
        assert not seq.block_table, "sequence already holds blocks"
        hits = self._lookup(seq)
        for block_id in hits:
            self._take(block_id)
        new = [self._allocate_new() for _ in range(self._blocks_for(seq.num_tokens) - len(hits))]
        seq.block_table = hits + new
        seq.block_table_dirty_from = 0
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_cached_tokens

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
            self.num_cached_free_blocks -= block.hash is not None
        block.ref_count += 1

    def _allocate_new(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:                      # evict its cached contents
            self.num_cached_free_blocks -= 1
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    # ---- growth and copy-on-write --------------------------------------------------------
    def _needs_copy(self, seq: Sequence) -> bool:
        """The next token lands in a partly filled block that someone else also holds."""
        pos = seq.num_computed_tokens
        idx = pos // self.block_size
        return (pos % self.block_size != 0 and idx < len(seq.block_table)
                and self.blocks[seq.block_table[idx]].ref_count > 1)

    def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = self._blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self._new_blocks_needed(seq, num_new_tokens) + int(self._needs_copy(seq))
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for the next `num_new_tokens` tokens; returns block copies to perform."""
        copies = []
        if self._needs_copy(seq):
            idx = seq.num_computed_tokens // self.block_size
            src = seq.block_table[idx]
            dst = self._allocate_new()
            self.blocks[src].ref_count -= 1
            seq.block_table[idx] = dst
            seq.block_table_dirty_from = min(seq.block_table_dirty_from, idx)
            copies.append((src, dst))
        needed = self._new_blocks_needed(seq, num_new_tokens)
        if needed:
            seq.block_table_dirty_from = min(seq.block_table_dirty_from, len(seq.block_table))
            seq.block_table.extend(self._allocate_new() for _ in range(needed))
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        child.block_table_dirty_from = 0
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens (slots reserved for speculative
        tokens that were rejected). Their contents were never entered in the prefix cache."""
        keep = self._blocks_for(num_tokens)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block, last first (tails are evicted before prefixes)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                self.num_cached_free_blocks += block.hash is not None

    # ---- release and caching -------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Tail blocks are queued for eviction first, so that
        shared prefixes survive longest."""
        self._release(seq.block_table)
        seq.block_table = []
        seq.block_table_dirty_from = 0
        seq.num_registered_blocks = 0

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's newly completed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        self._update_hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, tuple(seq.block_tokens(i))
                self.cached[h] = block.block_id
        seq.num_registered_blocks = full

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_queue:
            self.blocks[block_id].hash = self.blocks[block_id].token_ids = None
        self.num_cached_free_blocks = 0
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].hash == h}
