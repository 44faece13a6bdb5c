"""train_drafter on a tiny model: its own answers generated once and cached, heads that learn
them (loss falls, top-1 rises), a drafter directory MedusaHeads loads, and bad options refused."""
import json

import pytest

from kvslim.drafters.medusa import MedusaHeads
from kvslim.errors import KvslimError
from kvslim.train.drafter import DATA_FILE, DrafterTrainConfig, train_drafter


def test_heads_learn_the_models_own_answers(hf_checkpoints, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"the kernel {i} memory" for i in range(12)))
    cfg = DrafterTrainConfig(str(hf_checkpoints["gqa"]), str(tmp_path / "d"), str(prompts),
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


def test_an_unbuilt_kind_is_refused():
    with pytest.raises(KvslimError, match="eagle"):
        DrafterTrainConfig(None, "out", "p.txt", kind="eagle")
