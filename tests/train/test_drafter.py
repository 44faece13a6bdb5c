"""train_drafter on a tiny model: its own answers generated once and cached, Medusa heads and an
EAGLE head that learn them (loss falls, top-1 rises), drafter directories that load, the draft
vocabulary's choice, and bad options refused."""
import json
from dataclasses import replace

import pytest

from kvslim.drafters.eagle import EagleHead
from kvslim.drafters.medusa import MedusaHeads
from kvslim.errors import KvslimError
from kvslim.train import drafter
from kvslim.train.drafter import DATA_FILE, DrafterTrainConfig, train_drafter
from kvslim.train.eagle import draft_vocabulary


def write_prompts(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"the kernel {i} memory" for i in range(12)))
    return str(prompts)


def test_heads_learn_the_models_own_answers(hf_checkpoints, tmp_path):
    cfg = DrafterTrainConfig(str(hf_checkpoints["gqa"]), str(tmp_path / "d"),
                             write_prompts(tmp_path),
                             chat=False, heads=2, tokens=12 * 24, max_answer_tokens=24,
                             steps=60, batch_positions=64, lr=3e-3, log_every=10)
    summary = train_drafter(cfg, show_progress=False)
    first, last = summary["log"][0], summary["log"][-1]
    assert last["loss"] < first["loss"] and last["top1"][0] > first["top1"][0]
    heads = MedusaHeads.load(tmp_path / "d")
    assert heads.num_heads == 2 and heads.config.share_lm_head
    cached = json.loads((tmp_path / "d" / DATA_FILE).read_text())
    assert len(cached["pairs"]) == 12 and all(len(a) == 24 for _, a in cached["pairs"])
    # A second run with the same data options reads the cache instead of generating again.
    (tmp_path / "d" / DATA_FILE).write_text(json.dumps(cached | {"pairs": cached["pairs"][:3]}))
    again = train_drafter(cfg, show_progress=False)
    assert again["sequences"] == 3


def test_an_eagle_head_learns_the_models_own_answers(hf_checkpoints, tmp_path, monkeypatch):
    cfg = DrafterTrainConfig(str(hf_checkpoints["gqa"]), str(tmp_path / "e"),
                             write_prompts(tmp_path), kind="eagle", chat=False,
                             tokens=12 * 24, max_answer_tokens=24, window=8, draft_vocab=40,
                             unroll=2, steps=60, batch_positions=64, lr=1e-2, log_every=10)
    summary = train_drafter(cfg, show_progress=False)
    first, last = summary["log"][0], summary["log"][-1]
    assert last["loss"] < first["loss"] and last["top1"] > first["top1"]
    head = EagleHead.load(tmp_path / "e")
    assert head.config.window == 8 and len(head.draft_ids) == 40
    answers = [a for _, a in json.loads((tmp_path / "e" / DATA_FILE).read_text())["pairs"]]
    said = {t for a in answers for t in a}
    assert said <= set(head.draft_ids.tolist()) or len(said) > 40
    # Another try on the same sequences reads the model's hidden states back from OUT.
    monkeypatch.setattr(drafter, "_hidden_states", None)
    assert train_drafter(replace(cfg, steps=2, log_every=1), show_progress=False)["log"]


def test_the_draft_vocabulary_is_the_most_said_tokens_then_the_lowest_ids():
    answers = [[9, 9, 9, 4, 4, 7], [4, 9, 12]]
    assert draft_vocabulary(answers, 3, 20, always=[2]).tolist() == [2, 9, 4]
    assert draft_vocabulary(answers, 7, 20, always=[2]).tolist() == [2, 9, 4, 7, 12, 0, 1]


def test_an_unknown_kind_and_no_pass_are_refused():
    with pytest.raises(KvslimError, match="drafter kind must be one of medusa, eagle"):
        DrafterTrainConfig(None, "out", "p.txt", kind="hydra")
    with pytest.raises(KvslimError, match="--unroll must be at least 1, got 0"):
        DrafterTrainConfig(None, "out", "p.txt", kind="eagle", unroll=0)
