"""The replica router alone (kvslim.scaleout.router: pure Python, no Ray): the prefix index's
block keys, its matches and its LRU bound, and the three policies' choices."""
import pytest

from kvslim.scaleout.router import (ROUTING_POLICIES, PrefixIndex, Router, RouterConfig,
                                    block_keys)

BLOCK = 4


def prompt(prefix: int, suffix: int, length: int = 16) -> list[int]:
    """`length` tokens: a prefix shared by every prompt of group `prefix` (12 tokens, three
    blocks), then the prompt's own tokens."""
    return [1000 * prefix + i for i in range(12)] + [7000 + suffix] * (length - 12)


def router(policy: str, replicas: int = 2, capacity: int = 1000) -> Router:
    return Router(replicas, RouterConfig(policy, block_size=BLOCK, capacity_blocks=capacity))


def test_block_keys_cover_whole_blocks_and_what_precedes_them():
    a, b = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK), block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a == b                   # the partial block has no key
    c = block_keys([0, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert c[0] != a[0] and c[1] != a[1]            # same second block, other prefix
    assert block_keys([1, 2, 3], BLOCK) == []


def test_index_matches_the_leading_run_only():
    index = PrefixIndex(2, BLOCK, capacity=100)
    keys = block_keys(list(range(16)), BLOCK)
    index.insert(0, keys[:3])
    assert index.matched(0, keys) == 3
    assert index.matched(1, keys) == 0
    other = block_keys([99] + list(range(1, 16)), BLOCK)   # first block differs
    assert index.matched(0, other) == 0


def test_index_forgets_leaves_before_their_prefix():
    index = PrefixIndex(1, BLOCK, capacity=4)
    first = block_keys(list(range(12)), BLOCK)              # 3 blocks
    index.insert(0, first)
    second = block_keys(list(range(100, 112)), BLOCK)       # 3 more: 2 of first go
    index.insert(0, second)
    assert index.size(0) == 4
    assert index.matched(0, second) == 3
    assert index.matched(0, first) == 1                     # its prefix block stayed longest
    index.forget(0)
    assert index.size(0) == 0 and index.matched(0, second) == 0


def test_prefix_policy_keeps_a_shared_prefix_on_one_replica():
    r = router("prefix")
    chosen = set()
    for i in range(6):
        route = r.choose([prompt(1, i)], ready=[0, 1])
        r.started(route.replica)                            # in flight: still one replica
        chosen.add(route.replica)
        assert route.matched_blocks == (0 if i == 0 else 3)
    assert len(chosen) == 1


def test_prefix_policy_sends_new_prefixes_to_the_least_loaded():
    r = router("prefix")
    first = r.choose([prompt(1, 0)], ready=[0, 1]).replica
    r.started(first, 3)
    second = r.choose([prompt(2, 0)], ready=[0, 1])
    assert second.replica != first and second.matched_blocks == 0


def test_prefix_policy_gives_way_when_loads_are_far_apart():
    r = Router(2, RouterConfig("prefix", block_size=BLOCK, balance_abs_threshold=4,
                               balance_rel_threshold=1.5))
    home = r.choose([prompt(1, 0)], ready=[0, 1]).replica
    r.started(home, 10)
    assert r.choose([prompt(1, 1)], ready=[0, 1]).replica != home


def test_round_robin_alternates_and_least_loaded_follows_the_load():
    rr = router("round-robin")
    assert [rr.choose([prompt(1, i)], ready=[0, 1]).replica for i in range(4)] == [0, 1, 0, 1]
    least = router("least-loaded", replicas=3)
    least.started(0, 2)
    least.started(2, 1)
    assert least.choose([prompt(1, 0)], ready=[0, 1, 2]).replica == 1
    least.finished(0, 2)
    assert least.choose([prompt(1, 0)], ready=[0, 2]).replica == 0


def test_only_ready_replicas_are_chosen():
    for policy in ROUTING_POLICIES:
        r = router(policy, replicas=3)
        assert {r.choose([prompt(1, i)], ready=[2]).replica for i in range(3)} == {2}
        with pytest.raises(ValueError):
            r.choose([prompt(1, 0)], ready=[])


def test_a_restarted_replica_has_no_prefix_left():
    r = router("prefix")
    home = r.choose([prompt(1, 0)], ready=[0, 1]).replica
    r.forget(home)
    assert r.choose([prompt(1, 1)], ready=[0, 1]).matched_blocks == 0


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="routing policy"):
        router("random")
