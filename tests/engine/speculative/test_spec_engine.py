"""Speculative decoding in the engine: greedy output identical to plain decoding (n-gram drafts,
k in {1, 3, 5}, preemption forced by a tiny cache), stops, logprobs, n > 1, prefix caching,
seeded reproducibility, no leaked blocks (engine_helpers.run checks that)."""
import pytest

from engine.engine_helpers import GREEDY, engine, run, tokens
from kvslim.engine.sampling_params import SamplingParams

# Token-id prompts with repeats, so the n-gram proposer finds matches in prompt and output.
PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, list(range(40, 60)) + list(range(40, 50)), [3, 1, 4, 1, 5, 9],
           [100 + (i % 7) for i in range(30)]]


def spec(k: int, draft=None, **extra) -> dict:
    """Speculation at every batch size (the default stops above one sequence)."""
    extra.setdefault("disable_by_batch_size", None)
    if draft is not None:
        return dict(method="draft", model=str(draft), num_speculative_tokens=k, **extra)
    return dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                prompt_lookup_max=3, **extra)


# The target is "gqa"; drafts: itself (everything accepted) and an unrelated random model of
# the same vocabulary (mostly rejected).
PROPOSERS = [None, "gqa", "mqa"]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("cache", ["ample", "tiny"])
@pytest.mark.parametrize("draft", PROPOSERS, ids=["ngram", "draft-self", "draft-other"])
def test_greedy_output_equals_plain_decoding(hf_checkpoints, k, cache, draft):
    params = SamplingParams(max_tokens=40, **GREEDY)
    memory = "8MiB"
    if cache == "tiny":                   # 24 blocks of 4 tokens: preemptions must happen
        memory = 24 * engine(hf_checkpoints["gqa"], block_size=4).runner.bytes_per_block
    plain = engine(hf_checkpoints["gqa"], block_size=4, kv_cache_memory=memory)
    fast = engine(hf_checkpoints["gqa"], block_size=4, kv_cache_memory=memory,
                  speculative=spec(k, draft and hf_checkpoints[draft]))
    assert tokens(run(fast, PROMPTS, params)) == tokens(run(plain, PROMPTS, params))
    stats = fast.spec_decode_stats()
    assert stats.num_draft_tokens > 0
    if draft == "gqa":                    # the target drafting for itself
        assert stats.acceptance_rate > 0.9
    elif draft is None:
        assert stats.num_accepted_tokens > 0
    if cache == "tiny":
        assert fast.kv_cache_stats().num_preemptions > 0
    if draft is not None:                 # the draft's own cache is empty again too
        assert fast.spec.draft.block_manager.num_used_blocks == 0
        assert not fast.spec.draft.mirrors


@pytest.mark.parametrize("draft", PROPOSERS, ids=["ngram", "draft-self", "draft-other"])
def test_stops_max_tokens_and_logprobs_match_plain_decoding(hf_checkpoints, draft):
    plain = engine(hf_checkpoints["gqa"], block_size=4)
    fast = engine(hf_checkpoints["gqa"], block_size=4,
                  speculative=spec(4, draft and hf_checkpoints[draft]))
    free = run(plain, PROMPTS[:1], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
    stop_token = free.token_ids[9]
    text = free.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cases = [SamplingParams(max_tokens=30, stop_token_ids=[stop_token], **GREEDY),
             SamplingParams(max_tokens=30, stop=[stop], **GREEDY),
             SamplingParams(max_tokens=7, logprobs=3, **GREEDY),
             SamplingParams(max_tokens=25, min_tokens=20, stop_token_ids=[stop_token], **GREEDY),
             SamplingParams(max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.4,
                            **GREEDY)]
    for params in cases:
        a, b = (run(e, PROMPTS[:1], params)[0].outputs[0] for e in (plain, fast))
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
            (a.token_ids, a.text, a.finish_reason, a.stop_reason), params
        if params.logprobs:
            assert [lp.token_id for lp in b.logprobs] == b.token_ids
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert fast.spec_decode_stats().num_draft_tokens > 0
    if draft != "mqa":
        assert fast.spec_decode_stats().num_accepted_tokens > 0


def test_n_completions_and_prefix_cache_hits(hf_checkpoints):
    plain = engine(hf_checkpoints["gqa"], block_size=4)
    fast = engine(hf_checkpoints["gqa"], block_size=4, speculative=spec(3))
    params = SamplingParams(max_tokens=16, n=2, **GREEDY)
    for _ in range(2):                    # the second round hits the prefix cache
        a, b = (run(e, PROMPTS, params) for e in (plain, fast))
        assert [[c.token_ids for c in o.outputs] for o in b] == \
            [[c.token_ids for c in o.outputs] for o in a]
    assert fast.kv_cache_stats().prefix_cache_hits > 0


@pytest.mark.parametrize("draft", PROPOSERS, ids=["ngram", "draft-self", "draft-other"])
def test_seeded_sampling_is_reproducible(hf_checkpoints, draft):
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=s) for s in (1, 2)]
    outs = [tokens(run(engine(hf_checkpoints["gqa"],
                              speculative=spec(3, draft and hf_checkpoints[draft])),
                       PROMPTS[:2], params)) for _ in range(2)]
    assert outs[0] == outs[1]


def test_a_draft_with_another_vocabulary_is_refused(hf_checkpoints, tmp_path):
    import json
    import shutil
    other = tmp_path / "other"
    shutil.copytree(hf_checkpoints["mqa"], other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 999
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="vocabulary"):
        engine(hf_checkpoints["gqa"], speculative=spec(3, other))


def test_no_speculation_above_the_batch_size_limit(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], speculative=spec(3, disable_by_batch_size=2))
    run(eng, PROMPTS, SamplingParams(max_tokens=10, **GREEDY))        # 4 at once: never
    assert eng.spec_decode_stats().num_draft_tokens == 0
    run(eng, PROMPTS[:1], SamplingParams(max_tokens=10, **GREEDY))    # alone: speculates
    assert eng.spec_decode_stats().num_draft_tokens > 0


def test_abort_after_a_speculative_step_frees_every_block(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4, speculative=spec(5))
    ids = [eng.add_request(p, SamplingParams(max_tokens=40, **GREEDY)) for p in PROMPTS]
    for _ in range(6):
        eng.step()
    assert eng.spec_decode_stats().num_draft_tokens > 0
    for i in ids:
        eng.abort_request(i)
    assert eng.kv_cache_stats().num_used_blocks == 0


def test_abort_frees_the_draft_models_blocks(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], block_size=4, speculative=spec(3, hf_checkpoints["mqa"]))
    ids = [eng.add_request(p, SamplingParams(max_tokens=40, **GREEDY)) for p in PROMPTS]
    for _ in range(5):
        eng.step()
    assert eng.spec.draft.block_manager.num_used_blocks > 0
    for i in ids:
        eng.abort_request(i)
    assert eng.kv_cache_stats().num_used_blocks == 0
    assert eng.spec.draft.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("draft", PROPOSERS, ids=["ngram", "draft-self", "draft-other"])
def test_chunked_prefill_and_a_tight_token_budget(hf_checkpoints, draft):
    """Prompts split over steps and drafts cut to the step's token budget."""
    params = SamplingParams(max_tokens=24, **GREEDY)
    plain = engine(hf_checkpoints["gqa"], block_size=4, max_num_batched_tokens=7)
    fast = engine(hf_checkpoints["gqa"], block_size=4, max_num_batched_tokens=7,
                  speculative=spec(5, draft and hf_checkpoints[draft]))
    assert tokens(run(fast, PROMPTS, params)) == tokens(run(plain, PROMPTS, params))
    assert fast.spec_decode_stats().num_draft_tokens > 0


def test_a_draft_applies_the_requests_penalties_and_bias(hf_checkpoints):
    """The target drafting for itself under penalties, bias and min_tokens: its q is processed
    as p is, so (greedy) nearly every draft is accepted."""
    banned = 7
    params = SamplingParams(max_tokens=30, repetition_penalty=1.5, frequency_penalty=0.5,
                            logit_bias={banned: -100.0}, **GREEDY)
    plain = engine(hf_checkpoints["gqa"])
    fast = engine(hf_checkpoints["gqa"], speculative=spec(4, hf_checkpoints["gqa"]))
    assert tokens(run(fast, PROMPTS, params)) == tokens(run(plain, PROMPTS, params))
    assert fast.spec_decode_stats().acceptance_rate > 0.9
