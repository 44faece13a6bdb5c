"""`LookaheadProposer`: lookahead decoding (Fu et al. 2024), lossless and without a draft model.

Each step, per sequence, one tree of drafts below its last token holds both of lookahead's
branches: the verification branch, n-grams that start with that token (the suffix match prompt
lookup finds, then the sequence's pool: jacobi.py's trajectories and its own text), and the
lookahead branch, the Jacobi window's columns (jacobi.py). The engine verifies the tree as any
tree of drafts, in one forward with the tree's 2-D mask over the paged cache
(attention/tree.py): the walk keeps the longest path the target agrees with, whichever branch
it runs through, so greedy output is plain decoding's and sampling keeps the target's
distribution (verify.py's rules for trees). The runner then hands back the target's greedy
token at every row (`TreeTokens`); those after each column's path are the window's next
iteration."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvslim.engine.sequence import Sequence
from kvslim.engine.speculative.config import SpeculativeConfig
from kvslim.engine.speculative.jacobi import JacobiWindow
from kvslim.engine.speculative.ngram import NgramProposer
from kvslim.engine.speculative.ngram_pool import NgramPool
from kvslim.engine.speculative.path_tree import PathTree


class TreeTokens:
    """Per sequence, the target's greedy token at every row of its last tree of drafts (row 0:
    its last token), kept by the runner after the step (RunnerFeatures.tree_tokens)."""

    def __init__(self) -> None:
        self.rows: dict[int, list[int]] = {}

    def keep(self, seq_id: int, tokens: list[int]) -> None:
        self.rows[seq_id] = tokens

    def pop(self, seq_id: int) -> list[int] | None:
        return self.rows.pop(seq_id, None)


@dataclass
class _SeqLookahead:
    """One sequence's lookahead: its pool and window, and what its last tree was."""
    pool: NgramPool
    window: JacobiWindow
    root: int = -1                  # the last tree's root token
    num_tokens: int = 0             # the sequence's tokens then
    # per column of the window: the row after whose path the target guesses its next
    # iteration (0 the root; None: cut from the tree)
    column_rows: list[int | None] = field(default_factory=list)


class LookaheadProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.suffix = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                    config.ngram - 1)
        self.tree_tokens = TreeTokens()
        self.states: dict[int, _SeqLookahead] = {}

    def runner_feeds(self) -> dict:
        """What the runner keeps for it (RunnerFeatures' fields)."""
        return {"tree_tokens": self.tree_tokens}

    def propose(self, seqs: list[Sequence], room: list[int], chains_only
                ) -> dict[int, tuple[list[int], list[int] | None]]:
        """seq_id -> (drafts, parents) for a tree at most `room` deep; chains_only(seq): the
        sequences that verify a chain (their best n-gram alone)."""
        out = {}
        for seq, k in zip(seqs, room):
            state = self._catch_up(seq)
            if k > 0:
                out[seq.seq_id] = self._tree(seq, state, k, chains_only(seq))
        return out

    def _catch_up(self, seq: Sequence) -> _SeqLookahead:
        """The sequence's state after its last step: the window's iteration from the rows the
        runner kept, their n-grams and the sequence's new text in its pool."""
        cfg, tokens = self.config, seq.token_ids
        state = self.states.get(seq.seq_id)
        rows = self.tree_tokens.pop(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = _SeqLookahead(
                NgramPool(cfg.ngram, max(cfg.guesses, 1), cfg.pool_size),
                JacobiWindow.seeded(tokens, cfg.window, cfg.ngram))
        elif rows is not None and state.column_rows:
            outputs = [None if r is None or r >= len(rows) else rows[r]
                       for r in state.column_rows]
            for ngram in state.window.step(state.root, outputs, len(tokens) - state.num_tokens):
                state.pool.add(ngram)
        state.pool.add_text(tokens)
        return state

    def _tree(self, seq: Sequence, state: _SeqLookahead, k: int, chain_only: bool
              ) -> tuple[list[int], list[int] | None]:
        tokens = seq.token_ids
        candidates = []
        match = self.suffix.propose(tokens)
        if match:
            candidates.append(match)
        candidates += state.pool.continuations(tokens[-1], self.config.guesses)
        state.column_rows = []
        if chain_only:             # a grammar's masks follow one chain: the best guess
            return (list(candidates[0][:k]), None) if candidates else ([], None)
        tree = PathTree()
        for path in candidates:    # first: the sampler tries children in the order added
            tree.add(path)
        ends = [tree.add(path) for path in state.window.column_paths()]
        drafts, parents, order = tree.listed_by_depth(k)
        state.root, state.num_tokens = tokens[-1], len(tokens)
        state.column_rows = [0 if end < 0 else None if order[end] is None else order[end] + 1
                             for end in ends]
        return (drafts, parents) if drafts else ([], None)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.states.pop(seq_id, None)
            self.tree_tokens.pop(seq_id)
