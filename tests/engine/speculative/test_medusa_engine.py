"""Medusa heads in the engine: greedy output identical to plain decoding (random and untrained
heads, k up to the heads' number, preemption forced by a tiny cache, batched and alone), kept
hidden states forgotten with their sequences, and heads that do not fit refused before serving."""
import pytest
import torch

from engine.engine_helpers import engine
from engine.speculative.learned_helpers import greedy_equals_plain
from kvslim.drafters.medusa import MedusaConfig, MedusaHeads
from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig


def write_heads(path, model_dir, num_heads=3, scale=0.0, **config):
    """Heads for `model_dir`: untrained (scale 0: each guesses what the LM head guesses) or
    random (scale > 0)."""
    mc = ModelConfig.from_dir(model_dir)
    config = dict(dict(hidden_size=mc.hidden_size, vocab_size=mc.vocab_size), **config)
    heads = MedusaHeads(MedusaConfig(medusa_num_heads=num_heads, **config))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(scale * torch.randn_like(p))
    heads.save(path)
    return str(path)


def medusa(path, k, **extra):
    return dict(method="medusa", model=path, num_speculative_tokens=k,
                disable_by_batch_size=None, **extra)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("scale", [0.0, 0.5], ids=["untrained", "random"])
@pytest.mark.parametrize("cache", ["ample", "tiny"])
def test_greedy_output_equals_plain_decoding(hf_checkpoints, tmp_path, k, scale, cache):
    model = hf_checkpoints["gqa"]
    heads = write_heads(tmp_path / "heads", model, scale=scale)
    fast = greedy_equals_plain(model, medusa(heads, k), cache)
    if scale == 0.0:                      # "the next token again": right where the model repeats
        assert fast.spec_decode_stats().num_accepted_tokens > 0


def test_heads_that_do_not_fit_are_refused_before_serving(hf_checkpoints, tmp_path):
    model = hf_checkpoints["gqa"]
    other = write_heads(tmp_path / "other", model, hidden_size=8)
    with pytest.raises(KvslimError, match="trained for hidden size 8"):
        engine(model, speculative=medusa(other, 1))
    heads = write_heads(tmp_path / "heads", model, num_heads=2)
    with pytest.raises(KvslimError, match="num_speculative_tokens 3 is more than the 2 Medusa"):
        engine(model, speculative=medusa(heads, 3))
    with pytest.raises(KvslimError, match="not a Medusa drafter"):
        engine(model, speculative=medusa(str(tmp_path / "none"), 1))
    with pytest.raises(KvslimError, match="needs 'model'"):
        engine(model, speculative=dict(method="medusa"))
