"""EagleHead: save and load under EAGLE's key names with the draft vocabulary in EAGLE-3's form,
the windowed attention through kept K/V equal to the dense pass, and files or models it does not
fit refused."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvslim.drafters.eagle import (BIG, WEIGHTS_FILE, EagleConfig, EagleHead,
                                   WindowAttention)
from kvslim.errors import KvslimError

HIDDEN, VOCAB = 32, 50


def head(window=4, draft_vocab_size=0) -> EagleHead:
    torch.manual_seed(0)
    h = EagleHead(EagleConfig(HIDDEN, VOCAB, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, intermediate_size=48, window=window,
                              draft_vocab_size=draft_vocab_size))
    with torch.no_grad():
        for p in h.parameters():
            p.normal_(std=0.3)
    return h


def test_save_and_load_give_the_same_head_under_eagles_names(tmp_path):
    h = head(draft_vocab_size=6)
    h.set_draft_vocab(torch.tensor([7, 3, 49, 0, 12, 5]))
    h.save(tmp_path)
    keys = set(load_file(tmp_path / WEIGHTS_FILE))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
            "layers.0.self_attn.o_proj.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight",
            "d2t", "t2d"} == keys
    assert load_file(tmp_path / WEIGHTS_FILE)["layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    back = EagleHead.load(tmp_path)
    assert back.draft_ids.tolist() == [7, 3, 49, 0, 12, 5]
    assert back.t2d.sum() == 6 and back.t2d[49] and not back.t2d[1]
    for (name, a), (_, b) in zip(h.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_kept_keys_and_values_give_the_dense_pass(tmp_path):
    """The proposer's way (earlier positions' K/V in buffers, new rows written into slots, one
    position at a time) equals one dense causal pass over the sequence, window included."""
    h, T = head(window=3), 7
    emb, feats = torch.randn(1, T, HIDDEN), torch.randn(1, T, HIDDEN)
    positions = torch.arange(10, 10 + T)[None]
    with torch.no_grad():
        dense = h(emb, feats, positions, WindowAttention(3, positions,
                                                         key_valid=torch.ones(1, T, dtype=bool)))
        k_buf, v_buf = torch.zeros(1, T + 1, 2, 8), torch.zeros(1, T + 1, 2, 8)
        key_pos = torch.full((1, T + 1), BIG)
        first = 4                                     # a catch-up of 4 rows, then one at a time
        key_pos[0, :first] = positions[0, :first]
        slots = torch.arange(first)[None]
        out = [h(emb[:, :first], feats[:, :first], positions[:, :first],
                 WindowAttention(3, positions[:, :first], slots, k_buf, v_buf, key_pos))]
        for t in range(first, T):
            key_pos[0, t] = positions[0, t]
            out.append(h(emb[:, t:t + 1], feats[:, t:t + 1], positions[:, t:t + 1],
                         WindowAttention(3, positions[:, t:t + 1], torch.tensor([[t]]),
                                         k_buf, v_buf, key_pos)))
    # Values of order 10 (random weights of std 0.3), summed in other orders: float32 error.
    torch.testing.assert_close(torch.cat(out, dim=1), dense, rtol=1e-5, atol=1e-4)


def test_the_window_limits_what_a_position_sees():
    h, T = head(window=2), 6
    emb, feats = torch.randn(1, T, HIDDEN), torch.randn(1, T, HIDDEN)
    positions = torch.arange(T)[None]
    valid = torch.ones(1, T, dtype=bool)
    changed = feats.clone()
    changed[0, 0] += 1.0                              # position 0 is outside 2..5's windows
    with torch.no_grad():
        a = h(emb, feats, positions, WindowAttention(2, positions, key_valid=valid))
        b = h(emb, changed, positions, WindowAttention(2, positions, key_valid=valid))
    assert not torch.allclose(a[0, 1], b[0, 1])
    assert torch.equal(a[0, 2:], b[0, 2:])


def test_files_and_models_that_do_not_fit_are_refused(tmp_path):
    with pytest.raises(KvslimError, match="not an EAGLE drafter"):
        EagleHead.load(tmp_path)
    h = head()
    h.save(tmp_path)
    with pytest.raises(KvslimError, match="trained for hidden size 32 and vocabulary 50; m has "
                                          "64 and 50"):
        h.check_fits(64, 50, "m")
    state = load_file(tmp_path / WEIGHTS_FILE)
    del state["fc.bias"]
    save_file(state, tmp_path / WEIGHTS_FILE)
    with pytest.raises(KvslimError, match="fc.bias"):
        EagleHead.load(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(KvslimError, match="window must be >= 1"):
        EagleConfig(**{**config, "window": 0})
    with pytest.raises(KvslimError, match="draft_vocab_size must be within 0..50"):
        EagleConfig(**{**config, "draft_vocab_size": 51})
