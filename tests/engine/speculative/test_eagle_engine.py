"""An EAGLE head in the engine: greedy output identical to plain decoding (a head that copies its
input hidden state, and a random one; a full and a cut draft vocabulary; windows shorter and
longer than the answers; preemption forced by a tiny cache; prefix-cache hits; batched and
alone), its kept state forgotten with the sequences, and heads that do not fit refused."""
import pytest
import torch

from engine.engine_helpers import GREEDY, engine, run, tokens
from engine.speculative.learned_helpers import greedy_equals_plain
from engine.speculative.test_spec_engine import PROMPTS
from kvslim.drafters.eagle import EagleConfig, EagleHead
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig


def write_eagle(path, model_dir, kind="copy", window=8, draft_vocab=0, **config):
    """kind "copy": the head's output is its input hidden state (attention and MLP add zero), so
    its first draft is the token that state drew, again; "random": random weights."""
    mc = ModelConfig.from_dir(model_dir)
    head = EagleHead(EagleConfig.for_model(mc, window=window, draft_vocab_size=draft_vocab,
                                           **config))
    torch.manual_seed(1)
    with torch.no_grad():
        if kind == "copy":
            h = mc.hidden_size
            head.fc.weight.zero_()
            head.fc.weight[:, h:] = torch.eye(h)
            head.layers[0].self_attn.o_proj.weight.zero_()
            head.layers[0].mlp.down_proj.weight.zero_()
        else:
            for p in head.parameters():
                p.normal_(std=0.2)
    if draft_vocab:
        head.set_draft_vocab(torch.randperm(mc.vocab_size)[:draft_vocab])
    head.save(path)
    return str(path)


def eagle(path, k, **extra):
    return dict(method="eagle", model=path, num_speculative_tokens=k,
                disable_by_batch_size=None, **extra)


@pytest.mark.parametrize("kind, window, draft_vocab, k", [("copy", 64, 0, 3), ("random", 4, 0, 1),
                                                          ("random", 16, 100, 3)])
@pytest.mark.parametrize("cache", ["ample", "tiny"])
def test_greedy_output_equals_plain_decoding(hf_checkpoints, tmp_path, k, kind, window,
                                             draft_vocab, cache):
    model = hf_checkpoints["gqa"]
    head = write_eagle(tmp_path / "eagle", model, kind, window, draft_vocab)
    fast = greedy_equals_plain(model, eagle(head, k), cache)
    if kind == "copy":                    # "the latest token again": right where it repeats
        assert fast.spec_decode_stats().num_accepted_tokens > 0
    assert not fast.spec.learned.states


def test_prefix_cache_hits_keep_greedy_output(hf_checkpoints, tmp_path):
    """A second request with the same prompt skips its cached blocks: the head starts from the
    hidden states the engine does compute."""
    model = hf_checkpoints["gqa"]
    head = write_eagle(tmp_path / "eagle", model, "random", window=16)
    params = SamplingParams(max_tokens=30, **GREEDY)
    prompt = PROMPTS[0] * 3
    plain = engine(model, block_size=4)
    fast = engine(model, block_size=4, enable_prefix_caching=True, speculative=eagle(head, 2))
    expected = tokens(run(plain, [prompt], params))
    assert tokens(run(fast, [prompt], params)) == expected
    assert tokens(run(fast, [prompt, prompt], params)) == expected * 2
    assert fast.kv_cache_stats().prefix_cache_hits > 0


def test_heads_that_do_not_fit_are_refused_before_serving(hf_checkpoints, tmp_path):
    model = hf_checkpoints["gqa"]
    mc = ModelConfig.from_dir(model)
    other = write_eagle(tmp_path / "other", model, vocab_size=mc.vocab_size + 1)
    with pytest.raises(KvslimError, match=f"vocabulary {mc.vocab_size + 1}"):
        engine(model, speculative=eagle(other, 1))
    with pytest.raises(KvslimError, match="not an EAGLE drafter"):
        engine(model, speculative=eagle(str(tmp_path / "none"), 1))
    with pytest.raises(KvslimError, match="'eagle' needs 'model'"):
        engine(model, speculative=dict(method="eagle"))


def test_typical_acceptance_keeps_greedy_exact_and_samples(hf_checkpoints, tmp_path):
    model = hf_checkpoints["gqa"]
    head = write_eagle(tmp_path / "eagle", model)
    spec = eagle(head, 2, acceptance="typical")
    greedy_equals_plain(model, spec, "ample")
    fast = engine(model, block_size=4, speculative=spec)
    outs = run(fast, PROMPTS, SamplingParams(max_tokens=20, temperature=1.0, seed=3,
                                             ignore_eos=True))
    assert all(len(t) == 20 for t in tokens(outs))
    assert fast.spec_decode_stats().num_draft_tokens > 0
    assert fast.kv_cache_stats().num_used_blocks == 0


def test_gemma3_greedy_output_equals_plain_decoding(hf_checkpoints, tmp_path):
    """Gemma 3's shapes (a head_dim apart from hidden / heads, scaled embeddings, local and
    global layers): the head reads them from the model's config."""
    model = hf_checkpoints["gemma3"]
    head = write_eagle(tmp_path / "eagle", model, "random", window=16, draft_vocab=64)
    greedy_equals_plain(model, eagle(head, 2), "ample")
