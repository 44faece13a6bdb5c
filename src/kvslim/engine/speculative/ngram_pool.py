"""`NgramPool`: one sequence's n-grams for lookahead decoding to verify, keyed by their first
token. What lookahead's Jacobi iterations produce goes in, and so does the sequence's own text
(its prompt and accepted output), so the pool also holds what prompt lookup would copy.

Bounded twice: at most `per_token` continuations per first token (the most recently added:
nearby text predicts best, and a step verifies no more than that many anyway), and at most
`capacity` n-grams in all, the least recently added leaving first."""
from __future__ import annotations

from collections import OrderedDict


class NgramPool:
    def __init__(self, n: int, per_token: int, capacity: int):
        self.n, self.per_token, self.capacity = n, per_token, capacity
        self._by_first: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self._order: OrderedDict[tuple[int, ...], None] = OrderedDict()   # whole n-grams
        self.num_text_tokens = 0         # the sequence's tokens whose n-grams are in

    def __len__(self) -> int:
        return len(self._order)

    def add(self, ngram: tuple[int, ...]) -> None:
        """One n-gram of n tokens; added again, it counts as the newest."""
        first, rest = ngram[0], ngram[1:]
        follows = self._by_first.setdefault(first, OrderedDict())
        if rest in follows:
            follows.move_to_end(rest)
            self._order.move_to_end(ngram)
            return
        follows[rest] = None
        self._order[ngram] = None
        if len(follows) > self.per_token:
            self._forget((first, *follows.popitem(last=False)[0]))
        if len(self._order) > self.capacity:
            oldest = self._order.popitem(last=False)[0]
            self._by_first[oldest[0]].pop(oldest[1:], None)
            self._drop_empty(oldest[0])

    def _forget(self, ngram: tuple[int, ...]) -> None:
        self._order.pop(ngram, None)
        self._drop_empty(ngram[0])

    def _drop_empty(self, first: int) -> None:
        if not self._by_first.get(first, True):
            del self._by_first[first]

    def add_text(self, token_ids: list[int]) -> None:
        """The n-grams of the sequence's tokens not added yet (the first call: its prompt)."""
        n = self.n
        start = max(self.num_text_tokens - n + 1, 0)
        for i in range(start, len(token_ids) - n + 1):
            self.add(tuple(token_ids[i:i + n]))
        self.num_text_tokens = len(token_ids)

    def continuations(self, first: int, limit: int) -> list[tuple[int, ...]]:
        """Up to `limit` n - 1 tokens that followed `first`, the newest first."""
        follows = self._by_first.get(first)
        if not follows or limit <= 0:
            return []
        out = []
        for rest in reversed(follows):
            out.append(rest)
            if len(out) == limit:
                break
        return out
