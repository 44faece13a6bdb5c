"""Which replica serves a request (pure Python: no Ray, unit-tested alone).

`prefix` follows SGLang's cache-aware router: the router keeps an approximate index of what
each replica's prefix cache holds, built from the prompts it sent there, and sends a request to
the replica that holds the longest run of its prompt's leading blocks; with no replica holding
its first block, or when the loads are too far apart (both thresholds passed, as SGLang's
balance_abs_threshold and balance_rel_threshold), to the least loaded one. `least-loaded` and
`round-robin` ignore the prompt.

The index is keyed as the engine's own prefix cache is: a full block of `block_size` tokens,
chained to the blocks before it (its hash covers the whole prefix), so that a run of matching
keys is a run of shared leading blocks. It is approximate: each replica's record is capped at
its KV cache's blocks and forgets the least recently routed first (leaves before their parents),
as the engine evicts; what the engine generated is not recorded. A replica that restarted has
an empty cache: `forget` clears its record."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")


def block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """One key per full block of `tokens`, each covering every token before it too."""
    keys, parent = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        keys.append(parent)
    return keys


class PrefixIndex:
    """Per replica, the block keys it was sent recently, at most `capacity` of them."""

    def __init__(self, num_replicas: int, block_size: int, capacity: int):
        self.block_size = block_size
        self.capacity = capacity
        self._held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def matched(self, replica: int, keys: list[int]) -> int:
        """How many of `keys`, from the first, the replica holds."""
        held = self._held[replica]
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def insert(self, replica: int, keys: list[int]) -> None:
        """The replica now holds `keys`, as its most recent; the oldest go past the capacity.
        Inserted last to first, so that a prefix is more recent than what follows it."""
        held = self._held[replica]
        for key in reversed(keys):
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, replica: int) -> None:
        self._held[replica].clear()

    def size(self, replica: int) -> int:
        return len(self._held[replica])


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "prefix"
    block_size: int = 16                 # the engine's, so that keys are its blocks
    capacity_blocks: int = 4096          # per replica: its KV cache's blocks
    # SGLang's defaults: the loads count as apart when both hold (in-flight requests)
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5


@dataclass(frozen=True)
class Route:
    replica: int
    matched_blocks: int                  # of the first prompt's blocks, by the index


class Router:
    """Chooses among the ready replicas and counts each one's requests in flight."""

    def __init__(self, num_replicas: int, config: RouterConfig):
        if config.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {config.policy!r}: one of {ROUTING_POLICIES}")
        self.config = config
        self.index = PrefixIndex(num_replicas, config.block_size, config.capacity_blocks)
        self.load = [0] * num_replicas
        self._turn = 0

    def choose(self, prompts: Sequence[Sequence[int]], ready: Sequence[int]) -> Route:
        """The replica (one of `ready`, not empty) for a request of these prompts' tokens
        (a request's prompts go to one replica; the first one's prefix decides), recorded in
        the index as sent there. Load is counted by `started`/`finished`."""
        if not ready:
            raise ValueError("no replica is ready")
        keys = [block_keys(p, self.config.block_size) for p in prompts]
        route = self._pick(keys[0] if keys else [], list(ready))
        if self.config.policy == "prefix":
            for prompt_keys in keys:
                self.index.insert(route.replica, prompt_keys)
        return route

    def _pick(self, keys: list[int], ready: list[int]) -> Route:
        policy = self.config.policy
        if policy == "round-robin":
            replica = ready[self._turn % len(ready)]
            self._turn += 1
            return Route(replica, self.index.matched(replica, keys))
        least = min(ready, key=lambda r: (self.load[r], r))
        if policy == "least-loaded" or self._imbalanced(ready):
            return Route(least, self.index.matched(least, keys))
        matched = {r: self.index.matched(r, keys) for r in ready}
        best = max(ready, key=lambda r: (matched[r], -self.load[r], -r))
        if matched[best] == 0:
            return Route(least, 0)
        return Route(best, matched[best])

    def _imbalanced(self, ready: list[int]) -> bool:
        loads = [self.load[r] for r in ready]
        high, low = max(loads), min(loads)
        return (high - low > self.config.balance_abs_threshold
                and high > self.config.balance_rel_threshold * low)

    def started(self, replica: int, count: int = 1) -> None:
        self.load[replica] += count

    def finished(self, replica: int, count: int = 1) -> None:
        self.load[replica] = max(0, self.load[replica] - count)

    def forget(self, replica: int) -> None:
        """The replica restarted (or died): its prefix cache is empty."""
        self.index.forget(replica)
