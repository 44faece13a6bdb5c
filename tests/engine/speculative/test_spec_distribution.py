"""Sampling through the engine keeps the target's distribution: over many seeds, the joint
distribution of the first tokens drawn with a draft model's speculation, a trained EAGLE
head's, or a tree of Medusa candidates, matches plain sampling's (two-sample chi-squared), and
the same check fails with a broken acceptance rule."""
from collections import Counter

import pytest

from engine.engine_helpers import engine
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.speculative import verify

PROMPT = [11, 12, 13, 14, 15]
SAMPLES = 1500
Z_0001 = 3.0902                    # standard normal quantile for significance 0.001


def chi2_critical(dof: int) -> float:
    """Chi-squared quantile at significance 0.001 (Wilson-Hilferty, within 1% for dof >= 10)."""
    h = 2 / (9 * dof)
    return dof * (1 - h + Z_0001 * h ** 0.5) ** 3


def _pairs(eng) -> Counter:
    """(2nd, 3rd) generated token of SAMPLES seeded requests; both come from verification.
    With top_k = 4 there are at most 4 x 4 pairs after each first token, up to 64 in all."""
    for seed in range(SAMPLES):
        eng.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, top_k=4,
                                               seed=seed, ignore_eos=True))
    counts = Counter()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                counts[tuple(out.outputs[0].token_ids[1:])] += 1
    return counts


def _chi2(a: Counter, b: Counter) -> tuple[float, int]:
    cells = sorted(set(a) | set(b))
    stat = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cells)     # equal sample sizes
    return stat, len(cells) - 1


@pytest.fixture(scope="module")
def near_copy(hf_checkpoints, tmp_path_factory):
    """The target with its final norm rescaled per channel: a draft whose top tokens overlap
    the target's but whose probabilities differ, so drafts are accepted, rejected, and
    rejections draw from a residual that differs from p."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    out = tmp_path_factory.mktemp("draft") / "near"
    shutil.copytree(hf_checkpoints["gqa"], out)
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    norm = weights["model.norm.weight"]
    weights["model.norm.weight"] = norm * (0.4 + 1.2 * torch.rand(norm.shape, generator=g))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _speculating(hf_checkpoints, draft):
    spec = {"method": "draft", "model": str(draft), "num_speculative_tokens": 2,
            "disable_by_batch_size": None}
    return engine(hf_checkpoints["gqa"], max_num_seqs=64, speculative=spec)


@pytest.fixture(scope="module")
def plain_counts(hf_checkpoints):
    return _pairs(engine(hf_checkpoints["gqa"], max_num_seqs=64))


def test_speculative_sampling_matches_plain_sampling(hf_checkpoints, plain_counts, near_copy):
    eng = _speculating(hf_checkpoints, near_copy)
    stat, dof = _chi2(plain_counts, _pairs(eng))
    stats = eng.spec_decode_stats()
    assert 0.2 * stats.num_draft_tokens < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stat < chi2_critical(dof), (stat, dof)


def test_an_eagle_heads_sampling_matches_plain_sampling(hf_checkpoints, plain_counts, tmp_path):
    """A head trained on the target's own sampled continuations of PROMPT drafts tokens the
    target often samples there (one-hot drafts): each accepted with the target's probability of
    it, else a token drawn from the rest. (Medusa's drafts take the same path.)"""
    from kvslim.train.drafter import DrafterTrainConfig, train_drafter
    model = hf_checkpoints["gqa"]
    text = engine(model).tokenizer.decode(PROMPT)          # ")*+,-": encodes back to PROMPT
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([text] * 64))
    train_drafter(DrafterTrainConfig(str(model), str(tmp_path / "e"), str(prompts),
                                     kind="eagle", chat=False, tokens=64 * 4, max_answer_tokens=4,
                                     sampled_fraction=1.0, window=8, draft_vocab=0, steps=60,
                                     batch_positions=64, lr=1e-2), show_progress=False)
    spec = {"method": "eagle", "model": str(tmp_path / "e"), "num_speculative_tokens": 2,
            "disable_by_batch_size": None}
    eng = engine(model, max_num_seqs=64, speculative=spec)
    assert eng.tokenizer.encode(text) == PROMPT
    stat, dof = _chi2(plain_counts, _pairs(eng))
    stats = eng.spec_decode_stats()
    assert 0.1 * stats.num_draft_tokens < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stat < chi2_critical(dof), (stat, dof)


def test_a_medusa_trees_sampling_matches_plain_sampling(hf_checkpoints, plain_counts,
                                                       tmp_path):
    """Untrained Medusa heads guess the target's own best tokens of the position before: with
    four of them (max_tokens 3 leaves one depth), siblings are tried in turn and rejections
    taken out of p."""
    from engine.speculative.test_medusa_engine import write_heads
    model = hf_checkpoints["gqa"]
    heads = write_heads(tmp_path / "heads", model, scale=0.0)
    spec = {"method": "medusa", "model": heads, "disable_by_batch_size": None,
            "tree": [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [2, 0]]}
    eng = engine(model, max_num_seqs=64, speculative=spec)
    stat, dof = _chi2(plain_counts, _pairs(eng))
    stats = eng.spec_decode_stats()
    assert 0 < stats.num_accepted_off_chain < stats.num_draft_tokens
    assert stat < chi2_critical(dof), (stat, dof)


def test_the_check_sees_a_broken_rule(hf_checkpoints, plain_counts, near_copy, monkeypatch):
    monkeypatch.setattr(verify, "_residual", lambda p, token, q: p)
    stat, dof = _chi2(plain_counts, _pairs(_speculating(hf_checkpoints, near_copy)))
    assert stat > chi2_critical(dof), (stat, dof)
