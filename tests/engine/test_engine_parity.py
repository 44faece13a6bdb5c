"""The paged engine against HF transformers `generate`, greedy, token for token — together,
alone, under preemption, with chunked prefill and with prefix-cache hits — and its prompt
logprobs against transformers' logits."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import VOCAB
from engine_helpers import GREEDY, engine, hf_greedy, prompts_of, run, tokens
from kvslim.engine.sampling_params import SamplingParams

LENGTHS = [3, 17, 40, 5, 33, 64, 1, 20, 9]
NEW = 24
SHARED = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(9)).tolist()



@pytest.fixture(scope="module", params=["mha", "gqa", "mqa", "qwen2_bias", "tied", "qwen3", "phi3",
                                        "gemma3", "mixtral", "qwen3_moe", "llama3_rope",
                                        "yarn_rope"])
def case(request, hf_checkpoints):
    path = hf_checkpoints[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = prompts_of(LENGTHS)
    shared = prompts_of([4, 11, 7], seed=1, prefix=SHARED)
    return path, prompts, hf_greedy(hf, prompts, NEW), shared, hf_greedy(hf, shared, NEW)


PARAMS = SamplingParams(max_tokens=NEW, **GREEDY)


def test_batched_matches_transformers(case):
    path, prompts, refs, _, _ = case
    assert tokens(run(engine(path), prompts, PARAMS)) == refs


def test_prompt_logprobs_match_transformers_logits(case):
    """Every prompt position's log-softmax, batched through the paged engine in float32, within
    1e-4 of transformers' (the logits up to each position's constant)."""
    path, prompts, _, _, _ = case
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY)
    for out, prompt in zip(run(engine(path), prompts, params), prompts):
        assert len(out.prompt_logprobs) == len(prompt)
        if len(prompt) == 1:
            continue                            # a first token has no logprob
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
        want = ref[torch.arange(len(prompt) - 1), prompt[1:]]
        got = torch.tensor([entry.logprob for entry in out.prompt_logprobs[1:]])
        assert (got - want).abs().max().item() <= 1e-4


def test_each_alone_matches_transformers(case):
    path, prompts, refs, _, _ = case
    eng = engine(path)
    assert [tokens(run(eng, [p], PARAMS))[0] for p in prompts] == refs


def test_preemption_keeps_outputs_exact(case):
    path, prompts, refs, _, _ = case
    per_token = engine(path, kv_cache_memory="64KiB").kv_cache_stats().bytes_per_token
    eng = engine(path, kv_cache_memory=192 * per_token, block_size=8)  # 192 tokens, all layers
    assert tokens(run(eng, prompts, PARAMS)) == refs
    assert eng.kv_cache_stats().num_preemptions > 0


def test_chunked_prefill_keeps_outputs_exact(case):
    path, prompts, refs, _, _ = case
    eng = engine(path, max_num_batched_tokens=16)
    assert max(LENGTHS) > 16
    assert tokens(run(eng, prompts, PARAMS)) == refs


def test_prefix_cache_hits_keep_outputs_exact(case):
    path, _, _, shared, shared_refs = case
    eng = engine(path, block_size=8)
    first = run(eng, shared[:1], PARAMS)
    rest = run(eng, shared[1:], PARAMS)
    assert tokens(first + rest) == shared_refs
    assert all(o.metrics.num_cached_tokens == 48 for o in rest)   # 6 full blocks of SHARED
    stats = eng.kv_cache_stats()
    assert stats.prefix_cache_hits == 2 * 48 and stats.prefix_cache_queries > 0


def test_prefix_caching_off_gives_no_hits(case):
    path, _, _, shared, shared_refs = case
    eng = engine(path, block_size=8, enable_prefix_caching=False)
    assert tokens(run(eng, shared, PARAMS)) == shared_refs
    assert eng.kv_cache_stats().prefix_cache_hits == 0
