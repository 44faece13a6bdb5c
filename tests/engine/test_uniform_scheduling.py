"""Uniform token scheduling end to end: random workloads through `LLM.generate` on a tiny model
(token budgets down to 1, a cache small enough to preempt, n > 1, prompt logprobs, shared
prefixes) give every request the same tokens and prompt logprobs as running it alone."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoints import VOCAB
from engine_helpers import GREEDY
from kvslim import LLM, SamplingParams

BLOCK = 4


@pytest.fixture(scope="module")
def model_path(hf_checkpoints):
    return str(hf_checkpoints["gqa"])


@pytest.fixture(scope="module")
def alone(model_path):
    """Each request's reference output, from an engine that runs one request at a time."""
    llm = LLM(model_path, dtype="float32", device="cpu", kv_cache_memory="1MiB")
    cache = {}

    def run(prompt: list[int], params: SamplingParams):
        key = (tuple(prompt), params.n, params.max_tokens, params.prompt_logprobs)
        if key not in cache:
            (cache[key],) = llm.generate([prompt], params, use_tqdm=False)
        return cache[key]
    return run


def llm_for(model_path, **config) -> LLM:
    return LLM(model_path, dtype="float32", device="cpu", block_size=BLOCK, **config)


def check_same_as_alone(outputs, prompts, params, alone) -> None:
    for out, prompt, p in zip(outputs, prompts, params):
        ref = alone(prompt, p)
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]


def random_prompts(lengths, seed=0, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_one_token_prompt_chunks_keep_every_prompt_logprob(model_path, alone):
    """Budget 8 and these prompt lengths leave one-token chunks in the middle of prompts (this
    crashed the engine, or returned one prompt logprob short)."""
    prompts = random_prompts([56, 41, 79, 27])
    params = [SamplingParams(max_tokens=8, prompt_logprobs=2, **GREEDY)] * 4
    llm = llm_for(model_path, kv_cache_memory="1MiB", max_num_batched_tokens=8)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_same_as_alone(outputs, prompts, params, alone)
    assert llm.kv_cache_stats().num_used_blocks == 0


@st.composite
def workloads(draw):
    shared = random_prompts([12], seed=draw(st.integers(0, 3)))[0]
    requests = []
    for i in range(draw(st.integers(2, 6))):
        head = shared[:draw(st.sampled_from([0, 4, 9, 12]))]
        (prompt,) = random_prompts([draw(st.integers(1, 24))], seed=100 + i, prefix=head)
        params = SamplingParams(n=draw(st.integers(1, 3)), max_tokens=draw(st.integers(1, 8)),
                                prompt_logprobs=draw(st.sampled_from([None, 0, 2])), **GREEDY)
        requests.append((prompt, params))
    config = dict(max_num_batched_tokens=draw(st.sampled_from([1, 2, 3, 5, 8, 16])),
                  kv_cache_memory=draw(st.sampled_from(["10KiB", "12KiB", "16KiB"])),
                  max_num_seqs=draw(st.sampled_from([3, 4, 8])))
    return config, requests


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_random_workloads_match_each_request_alone(model_path, alone, workload):
    config, requests = workload
    llm = llm_for(model_path, **config)
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_same_as_alone(outputs, prompts, params, alone)
    assert llm.kv_cache_stats().num_used_blocks == 0


def test_forced_digest_collisions_serve_no_other_prefix(model_path, alone, monkeypatch):
    """Every block digest equal: prefixes that differ after their first block share one bucket;
    each request still gets its own K/V (hits are confirmed token by token)."""
    monkeypatch.setattr("kvslim.engine.sequence.block_hash", lambda parent, tokens: b"x")
    base = random_prompts([12], seed=7)[0]
    prompts = [base, base[:4] + random_prompts([8], seed=8)[0], base[:8] + [1, 2, 3, 4], base]
    params = [SamplingParams(max_tokens=6, **GREEDY)] * len(prompts)
    llm = llm_for(model_path, kv_cache_memory="1MiB")
    outputs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    check_same_as_alone(outputs, prompts, params, alone)
    assert llm.kv_cache_stats().prefix_cache_hits > 0           # the bucket's owner still hits
