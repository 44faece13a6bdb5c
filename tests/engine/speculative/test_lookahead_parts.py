"""Lookahead decoding's parts without a model: the pool's bounds, the tree of paths, the Jacobi
window's iteration and n-grams, and the 2-D mask of a lookahead step against a dense reference
built the way llama.cpp's lookahead example assigns its tokens to sequences."""
import torch

from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.scheduler import draft_tree_rows
from kvslim.engine.sequence import Sequence
from kvslim.engine.speculative.config import SpeculativeConfig
from kvslim.engine.speculative.jacobi import JacobiWindow
from kvslim.engine.speculative.lookahead import LookaheadProposer
from kvslim.engine.speculative.ngram_pool import NgramPool
from kvslim.engine.speculative.path_tree import PathTree


def test_pool_keeps_the_newest_continuations_per_token_and_in_all():
    pool = NgramPool(n=3, per_token=2, capacity=5)
    for ngram in [(1, 2, 3), (1, 4, 5), (1, 6, 7)]:        # a third after token 1: oldest out
        pool.add(ngram)
    assert pool.continuations(1, 5) == [(6, 7), (4, 5)]
    pool.add((1, 4, 5))                                    # seen again: the newest
    assert pool.continuations(1, 5) == [(4, 5), (6, 7)]
    assert pool.continuations(1, 1) == [(4, 5)] and pool.continuations(9, 3) == []
    for first in range(10, 16):                            # capacity 5 in all
        pool.add((first, 0, 0))
    assert len(pool) == 5
    assert pool.continuations(1, 5) == [] and pool.continuations(15, 1) == [(0, 0)]
    assert pool.continuations(10, 1) == []                  # the oldest of those went too


def test_pool_takes_each_new_n_gram_of_the_text_once():
    pool = NgramPool(n=3, per_token=4, capacity=100)
    pool.add_text([1, 2, 3, 1, 2])
    assert len(pool) == 3 and pool.continuations(1, 4) == [(2, 3)]
    pool.add_text([1, 2, 3, 1, 2, 4])                       # only (1, 2, 4) is new
    assert len(pool) == 4 and pool.continuations(1, 4) == [(2, 4), (2, 3)]


def test_path_tree_merges_prefixes_and_lists_by_depth():
    tree = PathTree()
    assert tree.add([5, 6, 7]) == 2 and tree.add([5, 8]) == 3 and tree.add([]) == -1
    assert tree.add([9]) == 4 and tree.add([5, 6]) == 1
    tokens, parents, order = tree.listed_by_depth()
    assert tokens == [5, 9, 6, 8, 7] and parents == [-1, -1, 0, 0, 2]
    assert order == [0, 2, 4, 3, 1]
    tokens, parents, order = tree.listed_by_depth(max_depth=1)
    assert tokens == [5, 9] and order == [0, None, None, None, 1]


def test_jacobi_n_grams_follow_the_trajectory():
    """A target whose next token depends on the last one only (t -> 3t + 1 mod 50), fed random
    guesses: one iteration makes every column a chain of the target's own steps, so from the
    second on, each column's n-gram (its levels, then the target's token after its path) is
    one the target itself would write — the diagonal of the Jacobi trajectory."""
    step = lambda t: (3 * t + 1) % 50                           # noqa: E731
    window = JacobiWindow([[40, 11, 27, 3], [44, 9, 30, 17]])   # window 4, ngram 3
    root = 1
    for iteration in range(4):
        outputs = [step(path[-1] if path else root) for path in window.column_paths()]
        ngrams = window.step(root, outputs, advance=1)
        assert len(ngrams) == 4 and ngrams[0][0] == root
        if iteration:
            assert all(ngram[1] == step(ngram[0]) and ngram[2] == step(ngram[1])
                       for ngram in ngrams[1:])
        root = step(root)


def test_jacobi_window_moves_by_the_accepted_tokens():
    window = JacobiWindow([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert window.column_paths() == [[5], [2, 6], [2, 3, 7], [2, 3, 4, 8]]
    ngrams = window.step(root=0, outputs=[10, None, 12, 13], advance=3)
    assert ngrams == [(0, 5, 10), (3, 7, 12), (4, 8, 13)]
    assert window.levels == [[7, 8, 8, 8], [12, 13, 13, 13]]    # two columns on, end repeated


def _reference_mask(root, levels, ngrams):
    """llama.cpp's lookahead batch: the root in every sequence; the first level's column i
    (i >= 1) in columns i.. (sequence c + 1 is column c); a later level's column i in column i
    only; n-gram g in sequence W + 1 + g alone. A row reads the rows of its first sequence at
    positions up to its own. Returns {path: the paths of the rows it reads}."""
    w = len(levels[0])
    rows = [(root, 0, set(range(w + 1 + len(ngrams))))]
    rows += [(levels[0][i], i, set(range(i + 1, w + 1))) for i in range(1, w)]
    rows += [(levels[j][i], i + j, {i + 1}) for j in range(1, len(levels)) for i in range(w)]
    rows += [(t, d + 1, {w + 1 + g}) for g, ngram in enumerate(ngrams) for d, t in enumerate(ngram)]
    first = [min(seqs) if len(seqs) < len(rows[0][2]) else 0 for _, _, seqs in rows]
    reads = [[b for b, (_, pos_b, seqs_b) in enumerate(rows)
              if (first[a] in seqs_b or a == 0 and b == 0) and pos_b <= rows[a][1]]
             for a in range(len(rows))]
    path = [tuple(rows[b][0] for b in sorted(r, key=lambda b: rows[b][1])[1:]) for r in reads]
    return {path[a]: {path[b] for b in reads[a]} for a in range(len(rows))}


def test_the_lookahead_steps_mask_matches_a_dense_reference():
    levels = [[100, 101, 102, 103], [110, 111, 112, 113], [120, 121, 122, 123]]  # W 4, N 4
    cfg = SpeculativeConfig(method="lookahead", window=4, ngram=4, guesses=2,
                            prompt_lookup_min=1, prompt_lookup_max=1)
    proposer = LookaheadProposer(cfg)
    prompt = [7, 1, 2, 3, 7, 4, 5, 6, 7]                  # after 7: (4, 5, 6) and (1, 2, 3)
    seq = Sequence(request_id="r", token_ids=prompt, params=SamplingParams(), block_size=4)
    proposer.propose([seq], [cfg.num_speculative_tokens], lambda s: False)  # pool from text
    proposer.states[seq.seq_id].window = JacobiWindow([list(row) for row in levels])
    drafts, parents = proposer.propose([seq], [cfg.num_speculative_tokens], lambda s: False)[
        seq.seq_id]
    tree = draft_tree_rows(parents)
    allowed = tree.ancestors(torch.device("cpu"))
    paths = [()]
    for parent, token in zip(parents, drafts):
        paths.append(paths[parent + 1] + (token,))
    ours = {paths[a]: {paths[b] for b in range(len(paths)) if allowed[a, b]}
            for a in range(len(paths))}
    assert list(tree.depths) == [len(p) for p in paths]      # position = root + depth
    assert ours == _reference_mask(7, levels, [(4, 5, 6), (1, 2, 3)])
    state = proposer.states[seq.seq_id]                        # each column's last row
    assert [paths[r] for r in state.column_rows] == [tuple(p) for p in
                                                    JacobiWindow(levels).column_paths()]
