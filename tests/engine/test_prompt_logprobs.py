"""Prompt logprobs (loglikelihood scoring): every prompt token's logprob equals what
transformers' logits give, also when the prompt is prefilled in chunks, preempted, or shares a
cached prefix, and for every one of n completions."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_helpers import GREEDY, engine, prompts_of, run
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError

LENGTHS = [1, 2, 17, 40, 64]



@pytest.fixture(scope="module", params=["gqa", "mqa"])
def case(request, hf_checkpoints):
    path = hf_checkpoints[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def hf_prompt_logprobs(hf, prompt):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(outputs, hf, prompts, k):
    for out, prompt in zip(outputs, prompts):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        ref = hf_prompt_logprobs(hf, prompt)
        for i in range(1, len(prompt)):
            entry = got[i]
            assert entry.token_id == prompt[i]
            assert entry.logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
            assert len(entry.top) == k
            if k:
                values, ids = ref[i - 1].topk(k)
                assert [t for t, _ in entry.top] == ids.tolist()


def test_prompt_logprobs_match_transformers(case):
    path, hf = case
    prompts = prompts_of(LENGTHS, seed=3)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY)
    check(run(engine(path), prompts, params), hf, prompts, 3)


def test_chunked_prefill_and_preemption_score_every_token_once(case):
    path, hf = case
    prompts = prompts_of([60, 45, 70, 50], seed=3)
    eng = engine(path, max_num_batched_tokens=16, kv_cache_memory="40KiB", max_num_seqs=4)
    params = SamplingParams(max_tokens=24, prompt_logprobs=0, **GREEDY)
    outputs = run(eng, prompts, params)
    assert eng.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    check(outputs, hf, prompts, 0)


def test_cached_prefix_is_recomputed_for_scoring(case):
    path, hf = case
    shared = prompts_of([48], seed=5)[0]
    prompts = prompts_of([5, 9], seed=6, prefix=shared)
    eng = engine(path)
    run(eng, [shared + [1]], SamplingParams(max_tokens=1, **GREEDY))     # fills the cache
    hits = eng.kv_cache_stats().prefix_cache_hits
    outputs = run(eng, prompts, SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY))
    check(outputs, hf, prompts, 1)
    assert eng.kv_cache_stats().prefix_cache_hits == hits
    plain = run(eng, prompts, SamplingParams(max_tokens=1, **GREEDY))
    assert plain[0].prompt_logprobs is None
    assert eng.kv_cache_stats().prefix_cache_hits > hits             # without scoring: hits


def test_n_completions_share_the_prompt_logprobs(case):
    path, hf = case
    prompts = prompts_of([12], seed=3)
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, prompt_logprobs=0)
    (out,) = run(engine(path), prompts, params)
    assert len(out.outputs) == 3
    check([out], hf, prompts, 0)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, "2"])
def test_bad_prompt_logprobs_name_the_field(bad):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.param == "prompt_logprobs"
