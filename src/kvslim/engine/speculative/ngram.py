"""`NgramProposer`: prompt-lookup decoding. The longest suffix of a sequence's tokens (between
`min_n` and `max_n` long) that occurred earlier in its prompt or output proposes the tokens
that followed that occurrence. No model: it pays off where outputs copy their input
(rewriting, summarising, code edits) and costs one wasted verification slot where they don't."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_tokens: int):
        self.min_n, self.max_n, self.num_tokens = min_n, max_n, num_tokens

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(num_tokens, max_tokens) tokens; [] when no suffix matches. Among
        earlier occurrences the latest wins (nearby text predicts best)."""
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._latest_match(tokens, n)
            if start is not None:
                follow = tokens[start + n:start + n + k]
                return follow.tolist()
        return []

    @staticmethod
    def _latest_match(tokens: np.ndarray, n: int) -> int | None:
        """Start of the latest occurrence of the last n tokens that ends before them."""
        suffix = tokens[-n:]
        windows = sliding_window_view(tokens[:-1], n)     # windows ending before the last token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        return int(hits[-1]) if hits.size else None
