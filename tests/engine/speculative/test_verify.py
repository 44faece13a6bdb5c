"""Exact acceptance: greedy keeps the argmax path; sampling keeps the target's distribution
(checked with a chi-squared test that a deliberately broken rule fails). Typical acceptance: its
entropy bar, and that it is not exact."""
import pytest
import torch

from kvslim.engine.speculative import verify
from kvslim.engine.speculative.verify import (TypicalAcceptance, pick_greedy, pick_sampled,
                                              verify_greedy, verify_sampled, verify_typical)

VOCAB, LENGTH, RUNS = 5, 3, 4000
CHI2_CRITICAL = 18.467          # chi-squared, 4 degrees of freedom, significance 0.001


def test_greedy_accepts_the_argmax_path_then_corrects():
    logits = torch.tensor([[0., 5, 1], [3, 1, 0], [0, 0, 9], [1, 2, 0]])
    assert verify_greedy(logits, [1, 0, 2]) == [1, 0, 2, 1]         # all accepted + bonus
    assert verify_greedy(logits, [1, 2, 2]) == [1, 0]                # second draft rejected
    assert verify_greedy(logits[:1], []) == [1]


def test_rows_must_match_the_drafts():
    with pytest.raises(ValueError, match="2 drafts need 3 target rows"):
        verify_sampled(torch.full((2, 4), 0.25), [1, 2], None)


def _positional(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(rows, VOCAB, generator=g), dim=-1)


def _generate(p: torch.Tensor, q: torch.Tensor | None, k: int, g: torch.Generator) -> list[int]:
    """LENGTH tokens from a context-free target (p[t] at output position t), k drafts a step:
    from q (a draft model) or always token 2 (one-hot, like an n-gram proposer)."""
    out: list[int] = []
    while len(out) < LENGTH:
        at = len(out)
        if q is None:
            drafts = [2] * k
        else:
            drafts = [int(torch.multinomial(q[at + i], 1, generator=g)) for i in range(k)]
        draft_probs = None if q is None else q[at:at + k]
        out += verify_sampled(p[at:at + k + 1], drafts, draft_probs, g)
    return out[:LENGTH]


def _chi2_per_position(p, q, k) -> list[float]:
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(LENGTH, VOCAB)
    for _ in range(RUNS):
        for t, token in enumerate(_generate(p, q, k, g)):
            counts[t, token] += 1
    expected = p[:LENGTH] * RUNS
    return (((counts - expected) ** 2) / expected).sum(dim=-1).tolist()


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-model", "ngram"])
@pytest.mark.parametrize("k", [1, 3])
def test_sampled_tokens_follow_the_target_distribution(one_hot, k):
    p = _positional(0, LENGTH + 4)
    q = None if one_hot else _positional(1, LENGTH + 4)
    assert max(_chi2_per_position(p, q, k)) < CHI2_CRITICAL


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-model", "ngram"])
def test_the_check_fails_when_the_rule_is_broken(one_hot, monkeypatch):
    """Drawing a rejected position from p instead of the residual biases the output towards
    the drafts: the same test must see it."""
    monkeypatch.setattr(verify, "_residual", lambda p, token, q: p)
    p = _positional(0, LENGTH + 4)
    q = None if one_hot else _positional(1, LENGTH + 4)
    assert max(_chi2_per_position(p, q, 3)) > CHI2_CRITICAL


def test_seeded_generators_reproduce():
    p, q = _positional(0, 4), _positional(1, 4)
    runs = [verify_sampled(p, [0, 1, 2], q[:3], torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_typical_acceptance_keeps_drafts_above_the_entropy_bar():
    """Bar = min(threshold, alpha * exp(-H(p))): a peaked row has a low entropy and a bar at the
    threshold; a flat row over 4 tokens a bar of alpha / 4."""
    rule = TypicalAcceptance(threshold=0.09, alpha=0.3)
    flat = torch.full((4,), 0.25)
    assert verify_typical(torch.stack([flat, flat]), [2], rule)[0] == 2       # 0.25 > 0.075
    peaked = torch.tensor([0.92, 0.08, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    rows = torch.stack([peaked, flat, flat])
    for _ in range(50):                    # 0.08 <= 0.09: rejected, drawn from p itself
        out = verify_typical(rows, [1, 3], rule, g)
        assert len(out) == 1 and out[0] in (0, 1)
    kept = verify_typical(torch.stack([peaked, flat, torch.eye(4)[3]]), [0, 1], rule, g)
    assert kept == [0, 1, 3]               # every draft kept: the bonus from the last row


def test_typical_acceptance_is_not_the_target_distribution():
    """Why it is an option: a draft the target gives 30% is kept every time."""
    p = torch.tensor([[0.3, 0.7], [0.5, 0.5]])
    g = torch.Generator().manual_seed(0)
    firsts = [verify_typical(p, [0], TypicalAcceptance(), g)[0] for _ in range(200)]
    assert firsts.count(0) == 200


def test_a_tree_row_takes_the_child_whose_draft_is_the_argmax():
    row = torch.tensor([0., 3, 9, 1])
    assert pick_greedy(row, [(5, 1), (6, 2)]) == (2, 6)
    assert pick_greedy(row, [(5, 1), (6, 3)]) == (2, None)       # no child drafted it
    assert pick_greedy(row, []) == (2, None)                     # a leaf: the bonus token


def _tree_row_counts(p: torch.Tensor, children, runs: int, exact: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(VOCAB)
    for _ in range(runs):
        token, child = pick_sampled(p, children, g)
        if exact:                        # a draft is only ever taken as its child's
            assert child == dict((d, r) for r, d in children).get(token)
        counts[token] += 1
    return counts


def test_a_tree_rows_sampled_token_follows_the_target_distribution(monkeypatch):
    """Three children tried in turn, each rejection taken out of the distribution: the token
    is a draw from p (chi-squared over the 5 tokens); drawing after the last rejection from p
    itself instead of what remains of it fails the same check."""
    p = _positional(3, 1)[0]
    children = [(1, 3), (2, 0), (3, 4)]
    counts = _tree_row_counts(p, children, RUNS)
    assert ((counts - p * RUNS) ** 2 / (p * RUNS)).sum() < CHI2_CRITICAL
    monkeypatch.setattr(verify, "_draw", lambda probs, g: int(torch.multinomial(p, 1,
                                                                                generator=g)))
    broken = _tree_row_counts(p, children, RUNS, exact=False)
    assert ((broken - p * RUNS) ** 2 / (p * RUNS)).sum() > CHI2_CRITICAL
