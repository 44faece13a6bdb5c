"""MedusaHeads: heads start as the model's LM head (zero residual blocks), save and load in
FasterDecoding's medusa_lm_head layout, and refuse files or models they do not fit."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvslim.drafters.medusa import WEIGHTS_FILE, MedusaConfig, MedusaHeads
from kvslim.errors import KvslimError

HIDDEN, VOCAB = 16, 40


def heads(**kw) -> MedusaHeads:
    torch.manual_seed(0)
    h = MedusaHeads(MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, **kw))
    for p in h.parameters():
        p.data.normal_()
    return h


def test_untrained_heads_guess_what_the_lm_head_guesses():
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    fresh = MedusaHeads(MedusaConfig(medusa_num_heads=2, hidden_size=HIDDEN, vocab_size=VOCAB))
    x = torch.randn(5, HIDDEN)
    logits = fresh(x, lm_head)
    assert logits.shape == (2, 5, VOCAB)
    for k in range(2):                                     # the blocks add exactly zero
        assert torch.allclose(logits[k], lm_head(x), rtol=0, atol=1e-6)
    assert torch.equal(fresh.features(x)[1], x)


@pytest.mark.parametrize("share", [True, False])
def test_save_and_load_give_the_same_heads_in_fasterdecodings_layout(tmp_path, share):
    h = heads(medusa_num_heads=3, medusa_num_layers=2, share_lm_head=share)
    h.save(tmp_path)
    keys = set(load_file(tmp_path / WEIGHTS_FILE))
    assert {"0.0.linear.weight", "2.1.linear.bias"} <= keys
    assert ("1.2.weight" in keys) == (not share)             # own LM heads after the blocks
    assert json.loads((tmp_path / "config.json").read_text())["medusa_num_heads"] == 3
    again = MedusaHeads.load(tmp_path)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    x = torch.randn(4, HIDDEN)
    assert torch.equal(again(x, lm_head), h(x, lm_head))


def test_a_file_missing_tensors_or_another_models_heads_are_refused(tmp_path):
    h = heads()
    h.save(tmp_path)
    state = load_file(tmp_path / WEIGHTS_FILE)
    del state["1.0.linear.bias"]
    save_file(state, tmp_path / WEIGHTS_FILE)
    with pytest.raises(KvslimError, match="1.0.linear.bias"):
        MedusaHeads.load(tmp_path)
    with pytest.raises(KvslimError, match="not a Medusa drafter"):
        MedusaHeads.load(tmp_path / "nothing")
    with pytest.raises(KvslimError, match="hidden size 16 and vocabulary 40; m has 32 and 40"):
        h.check_fits(32, VOCAB, "m")
    h.check_fits(HIDDEN, VOCAB, "m")
