"""Phi-3's LongRoPE: short factors within the original context, long ones beyond, and the
attention factor sqrt(1 + ln(factor) / ln(original context)).

transformers picks one set for a whole forward pass by its longest position, and its Phi-3
generation recomputes the cache with the long set when a sequence first outgrows the original
context. kvslim picks per position (as vLLM does: a paged cache keeps every token's K/V), so
it equals transformers exactly while a sequence stays within the original context (tested here
through the dense model and the paged engine), and each position's rotation equals
transformers' for that position beyond it; a sequence that outgrows the original context keeps
its first positions' short-rotated K/V (docs/architecture.md, layers/rope.py)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import VARIANTS, VOCAB
from engine_helpers import GREEDY, engine, hf_greedy, run, tokens
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
