"""`JacobiWindow`: lookahead decoding's 2-D window (Fu et al. 2024, arXiv 2402.02057): `window`
columns of guessed future tokens, `ngram` - 1 Jacobi iterations deep.

With the sequence's last token (the root) at position r, levels[j][i] guesses the token at
position r + i + j. Each step feeds, below the root, the first level as one chain (its column 0
is the root itself) and from each column's place on that chain the column's later levels:
column i's path is levels[0][1..i], then levels[1..ngram-2][i], each token attending to the
tokens before it on its path, exactly as llama.cpp's lookahead example masks them. The target's
greedy token after column i's path is one more Jacobi iteration at position r + i + ngram - 1;
with the column's levels it completes an n-gram of the trajectory (the pool's food), and the
window moves on: the oldest level leaves, the new tokens become the last.

Every guess here is only a proposal: the target verifies what is accepted, so the window's
quality changes the speed, never the output."""
from __future__ import annotations

import random


class JacobiWindow:
    def __init__(self, levels: list[list[int]]):
        self.levels = levels                        # [ngram - 1][window]

    @classmethod
    def seeded(cls, token_ids: list[int], window: int, ngram: int) -> "JacobiWindow":
        """Guesses drawn from the sequence's own tokens (the paper's initialisation), from a
        generator seeded by the sequence alone: nothing else in the batch changes them."""
        rng = random.Random(len(token_ids))
        return cls([[rng.choice(token_ids) for _ in range(window)] for _ in range(ngram - 1)])

    @property
    def width(self) -> int:
        return len(self.levels[0])

    def column_paths(self) -> list[list[int]]:
        """Per column, the tokens fed below the root on its path (column 0 with a 2-gram: none,
        the root's own output is its next iteration)."""
        first, later = self.levels[0], self.levels[1:]
        return [first[1:i + 1] + [level[i] for level in later] for i in range(self.width)]

    def step(self, root: int, outputs: list[int | None], advance: int) -> list[tuple[int, ...]]:
        """outputs[i]: the target's greedy token after column i's path (None where the step did
        not compute it: that column keeps its last level); `advance`: the tokens the sequence
        gained in the step (1 + the accepted drafts). Returns the n-grams the iteration
        completed and moves the window to the new root."""
        ngrams = []
        last = self.levels[-1]
        new = [last[i] if out is None else out for i, out in enumerate(outputs)]
        for i, out in enumerate(outputs):
            if out is not None:
                first = root if i == 0 else self.levels[0][i]
                ngrams.append((first, *(level[i] for level in self.levels[1:]), out))
        # Level j + 1, column i + advance - 1 guessed the position that level j, column i now
        # stands for; columns past the window's end repeat its last guess. A jump past the
        # whole window keeps the old guesses (guesses still, just less likely ones).
        skip = advance - 1
        if skip >= self.width:
            return ngrams
        extended = self.levels[1:] + [new]
        self.levels = [row[skip:] + [row[-1]] * skip for row in extended]
        return ngrams
