"""Phi-3's LongRoPE: short factors within the original context, long ones beyond, and the
attention factor sqrt(1 + ln(factor) / ln(original context)).

transformers picks one set for a whole forward pass by its longest position, and its Phi-3
generation recomputes the cache with the long set when a sequence first outgrows the original
context. kvslim does the same: a dense pass by its longest position, the engine per sequence
(a sequence longer than the original context is rotated by the long set at every position, and
recomputed when it grows past it), so greedy tokens equal transformers' own `generate` for
prompts below, at and beyond the original context, through the dense model and the paged
engine (batched, chunked, preempted, with prefix-cache hits and speculative steps)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import VARIANTS, VOCAB
from engine_helpers import GREEDY, engine, hf_greedy, prompts_of, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.formats.loader import load_model

ORIGINAL = VARIANTS["phi3_longrope"]["original_max_position_embeddings"]


@pytest.fixture(scope="module")
def models(hf_checkpoints):
    path = hf_checkpoints["phi3_longrope"]
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), \
        load_model(path, dtype=torch.float32)


def test_each_position_rotates_as_transformers_does(models):
    """Below the original context the short set, from it on the long set (transformers switches
    when a forward pass reaches the position), both with the same attention factor."""
    _, hf, ours = models
    x = torch.zeros(1, 1, hf.config.hidden_size)
    for pos in (0, ORIGINAL - 1, ORIGINAL, 3 * ORIGINAL):
        cos, sin = hf.model.rotary_emb(x, torch.tensor([[pos]]))
        our_cos, our_sin = ours.model.rotary.cos_sin(torch.tensor([pos]), torch.float32)
        torch.testing.assert_close(our_cos, cos[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(our_sin, sin[0], atol=1e-5, rtol=0)
    assert ours.model.rotary.attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling)
    assert ours.model.rotary.attention_factor > 1.25       # factor 512 / 48: it matters


def test_logits_within_the_original_context(models):
    _, hf, ours = models
    ids = torch.randint(0, VOCAB, (2, ORIGINAL), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (hf(ids).logits - ours.logits(ids)).abs().max().item()
    assert diff <= 1e-4


def test_paged_engine_matches_generate_within_the_original_context(models):
    """Batched, chunked and with prefix-cache hits, up to the original context."""
    path, hf, _ = models
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 24, 9)]
    prompts += [shared + [7, 8], shared + [9]]
    new = ORIGINAL - max(map(len, prompts))
    refs = hf_greedy(hf, prompts, new)
    params = SamplingParams(max_tokens=new, **GREEDY)
    eng = engine(path, max_num_batched_tokens=16, block_size=4)
    assert tokens(run(eng, prompts, params)) == refs
    assert eng.kv_cache_stats().prefix_cache_hits > 0


def test_logits_of_a_pass_beyond_the_original_context(models):
    """The whole pass takes the long factors, its first positions too."""
    _, hf, ours = models
    ids = torch.randint(0, VOCAB, (2, ORIGINAL + 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        diff = (hf(ids).logits - ours.logits(ids)).abs().max().item()
    assert diff <= 1e-4


# Prompts below the original context that grow past it, at it and one short of it, and beyond it
# from the start; a shared prefix between short and long ones (their blocks must not be shared).
LENGTHS = (2, 30, ORIGINAL - 1, ORIGINAL, ORIGINAL + 1, 90)


def crossing_prompts():
    prompts = prompts_of(LENGTHS, seed=7)
    shared = prompts[-1][:40]
    return prompts + [shared + [5], shared + prompts[0] * 10]


@pytest.mark.parametrize("setup", [
    dict(max_num_batched_tokens=16, block_size=4),
    dict(max_num_batched_tokens=64, block_size=8, kv_cache_memory="96KiB"),   # preempts
    dict(max_num_batched_tokens=64, block_size=4,
         speculative={"method": "ngram", "num_speculative_tokens": 3}),
    # the target as its own draft model: drafts are accepted, so verification steps would
    # span the original context's end
    dict(max_num_batched_tokens=64, block_size=4,
         speculative={"method": "draft", "model": "TARGET", "num_speculative_tokens": 4}),
], ids=["chunked", "preempted", "ngram", "draft"])
def test_paged_engine_matches_generate_across_the_original_context(models, setup):
    path, hf, _ = models
    prompts = crossing_prompts()
    new = 24
    refs = hf_greedy(hf, prompts, new)
    if "speculative" in setup and setup["speculative"].get("model") == "TARGET":
        setup = dict(setup, speculative=dict(setup["speculative"], model=str(path)))
    eng = engine(path, **setup)
    outs = run(eng, prompts, SamplingParams(max_tokens=new, **GREEDY))
    assert tokens(outs) == refs
    if "kv_cache_memory" in setup:
        assert eng.scheduler.num_preemptions > 0
    else:
        assert eng.kv_cache_stats().prefix_cache_hits > 0

