"""BlockManager: exact block ids, reference counts, prefix-cache hits, eviction order, CoW."""
from kvslim.engine.block_manager import BlockManager
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.sequence import Sequence

BS = 4


def seq(tokens) -> Sequence:
    return Sequence(request_id="r", token_ids=list(tokens), params=SamplingParams(), block_size=BS)


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Pretend the model computed all of the sequence's tokens."""
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    return s


def refs(bm, ids):
    return [bm.blocks[i].ref_count for i in ids]


def test_allocate_takes_blocks_in_order_and_counts():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(range(10))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    assert refs(bm, [0, 1, 2]) == [1, 1, 1]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 5)
    assert a.num_computed_tokens == 0 and a.num_cached_tokens == 0


def test_prefix_hits_share_blocks_and_are_counted():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq(range(10))
    bm.allocate(a)
    computed(bm, a)                               # full blocks 0 and 1 enter the cache
    b = seq(list(range(8)) + [99, 98])
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert refs(bm, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    c = seq(range(8))                             # the last token is always computed:
    bm.allocate(c)                                # only the first block may hit
    assert c.block_table == [0, 4] and c.num_cached_tokens == 4
    assert bm.prefix_cache_queries == 10 + 10 + 8
    assert bm.prefix_cache_hits == 8 + 4


def test_hit_is_verified_token_by_token():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = computed(bm, _allocated(bm, range(9)))
    # Forge a collision: another block claims block 0's hash with different tokens.
    bm.blocks[0].token_ids = (7, 7, 7, 7)
    b = seq(range(9))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table == [3, 4, 5]
    assert a.block_table == [0, 1, 2]


def _allocated(bm, tokens):
    s = seq(tokens)
    bm.allocate(s)
    return s


def test_free_keeps_cached_blocks_and_evicts_in_lru_order():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = computed(bm, _allocated(bm, range(10)))           # [0, 1, 2]
    b = computed(bm, _allocated(bm, list(range(8)) + [99, 98]))   # [0, 1, 3]
    c = computed(bm, _allocated(bm, range(8)))            # [0, 4]
    bm.free(a)
    assert list(bm.free_queue) == [5, 6, 7, 2]            # tail block first, shared ones stay
    bm.free(b)
    assert list(bm.free_queue) == [5, 6, 7, 2, 3, 1]
    bm.free(c)
    assert list(bm.free_queue) == [5, 6, 7, 2, 3, 1, 4, 0]
    assert bm.num_used_blocks == 0
    # Blocks 0 and 1 hold cached prefixes; block 4 has block 1's contents again (computed by c
    # before it could hit), so it was not entered twice.
    assert bm.num_cached_free_blocks == 2
    d = _allocated(bm, range(100, 124))                   # 6 blocks: evicts 5,6,7,2,3,1
    assert d.block_table == [5, 6, 7, 2, 3, 1]
    e = seq(list(range(4)) + [1])
    assert bm.can_allocate(e)
    bm.allocate(e)                                        # block 0 survived, block 1 was evicted
    assert e.block_table == [0, 4] and e.num_cached_tokens == 4
    assert bm.prefix_cache_hits == 8 + 4 + 4
    scanned = sum(1 for b in bm.free_queue if bm.blocks[b].hash is not None)
    assert bm.num_cached_free_blocks == scanned


def test_can_allocate_counts_revived_blocks_and_watermark():
    bm = BlockManager(num_blocks=4, block_size=BS, watermark_blocks=1)
    a = computed(bm, _allocated(bm, range(9)))            # 3 blocks
    bm.free(a)
    b = seq(list(range(8)) + [5, 6, 7, 8, 9])             # 2 hits (revived) + 2 new = 4 blocks
    assert not bm.can_allocate(b)                         # watermark would be broken
    assert bm.can_allocate(b, keep_watermark=False)


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = computed(bm, _allocated(bm, range(6)))       # [0, 1], block 1 half full
    child = parent.fork(1)
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and refs(bm, [0, 1]) == [2, 2]
    child.token_ids.append(50)
    assert bm.can_append(child, 1)
    copies = bm.append_slots(child, 1)
    assert copies == [(1, 2)] and child.block_table == [0, 2]
    assert refs(bm, [0, 1, 2]) == [2, 1, 1]
    parent.token_ids.append(60)
    assert bm.append_slots(parent, 1) == []               # sole owner now: writes in place
    assert parent.block_table == [0, 1]
    bm.free(parent)
    bm.free(child)
    assert bm.num_used_blocks == 0


def test_append_allocates_at_block_boundary():
    bm = BlockManager(num_blocks=3, block_size=BS)
    s = computed(bm, _allocated(bm, range(8)))            # exactly two full blocks
    s.block_table_dirty_from = 2                          # as if the runner had synced
    s.token_ids.append(1)
    assert bm.append_slots(s, 1) == [] and s.block_table == [0, 1, 2]
    assert s.block_table_dirty_from == 2
    s.num_computed_tokens = 9
    s.token_ids += [2, 3, 4, 5]
    assert not bm.can_append(s, 4)                        # would need a 4th block
