"""Admission: a request the engine could never run is refused by add_request with an error naming
the field, and nothing a validated request carries can make `step()` raise."""
import pytest

from engine_helpers import GREEDY, engine, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError

PROMPT = list(range(10, 30))


def refused(eng, prompt, params) -> InvalidRequestError:
    """add_request fails, and the engine still serves a normal request with nothing leaked."""
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(prompt, params)
    assert not eng.has_unfinished_requests()
    out = run(eng, [PROMPT], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.error is None
    return err.value


def test_n_above_max_num_seqs_is_refused(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], max_num_seqs=4)
    err = refused(eng, PROMPT, SamplingParams(n=5, max_tokens=2))
    assert err.param == "n"
    assert str(err) == ("n=5 exceeds the engine's max_num_seqs (4): the n completions run as "
                        "that many sequences at once")
    out = run(eng, [PROMPT], SamplingParams(n=4, max_tokens=2))[0]     # the limit itself runs
    assert [len(c.token_ids) for c in out.outputs] == [2, 2, 2, 2]


def test_without_chunked_prefill_a_prompt_over_the_step_budget_is_refused(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"], enable_chunked_prefill=False, max_num_batched_tokens=32,
                 max_model_len=256)
    err = refused(eng, list(range(10, 60)), SamplingParams(max_tokens=2))
    assert err.param == "prompt"
    assert str(err) == ("prompt has 50 tokens, but without chunked prefill a step computes at "
                        "most max_num_batched_tokens=32")


def test_without_chunked_prefill_a_preempted_sequence_longer_than_the_budget_completes(
        hf_checkpoints):
    """Its recompute (prompt + output so far) outgrows the step budget: it is chunked rather
    than left waiting forever."""
    path = hf_checkpoints["gqa"]
    params = SamplingParams(max_tokens=40, **GREEDY)
    prompts = [list(range(10, 30)), list(range(40, 60))]
    alone = [tokens(run(engine(path), [p], params))[0] for p in prompts]
    eng = engine(path, enable_chunked_prefill=False, max_num_batched_tokens=24, block_size=4,
                 kv_cache_memory="16KiB")                  # 64 tokens: the two cannot both fit
    assert tokens(run(eng, prompts, params)) == alone
    assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("seed", [2**70, 2**64, -2**63 - 1])
def test_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(seed=seed)
    assert err.value.param == "seed"
    assert str(err.value) == f"seed must be an integer in [-2**63, 2**64 - 1], got {seed}"


def test_seeds_at_the_64_bit_bounds_sample(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"])
    params = [SamplingParams(seed=s, n=2, max_tokens=3) for s in (2**64 - 1, -2**63)]
    outs = run(eng, [PROMPT, PROMPT], params)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [3, 3, 3, 3]


@pytest.mark.parametrize("field,value,message", [
    ("temperature", float("inf"), "temperature must be a finite number >= 0, got inf"),
    ("temperature", float("nan"), "temperature must be a finite number >= 0, got nan"),
    ("repetition_penalty", 1e308, "repetition_penalty must be in [1e-06, 1e+06], got 1e+308"),
    ("repetition_penalty", 1e-320, "repetition_penalty must be in [1e-06, 1e+06], got 1e-320"),
])
def test_floats_that_turn_logits_to_nan_are_refused(field, value, message):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and str(err.value) == message


def test_a_tiny_temperature_is_greedy(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"])
    greedy = run(eng, [PROMPT], SamplingParams(max_tokens=4, **GREEDY))
    tiny = run(eng, [PROMPT], SamplingParams(max_tokens=4, temperature=1e-46, ignore_eos=True))
    assert tokens(tiny) == tokens(greedy)


def test_top_k_beyond_the_vocabulary_is_off(hf_checkpoints):
    eng = engine(hf_checkpoints["gqa"])
    off = run(eng, [PROMPT], SamplingParams(max_tokens=4, seed=7, ignore_eos=True))
    huge = run(eng, [PROMPT], SamplingParams(max_tokens=4, seed=7, top_k=2**70, ignore_eos=True))
    assert tokens(huge) == tokens(off)


def test_an_unschedulable_request_fails_alone(hf_checkpoints, monkeypatch):
    """The guard behind the checks: the head of the queue cannot be admitted with the engine
    idle. That request ends with an error; the one behind it runs."""
    eng = engine(hf_checkpoints["gqa"])
    bad = eng.add_request(PROMPT, SamplingParams(n=2, max_tokens=2))
    good = eng.add_request(PROMPT[1:], SamplingParams(max_tokens=2, **GREEDY))
    allocate = eng.block_manager.can_allocate
    monkeypatch.setattr(eng.block_manager, "can_allocate",
                        lambda seq, **kw: seq.request_id != bad and allocate(seq, **kw))
    first = eng.step()
    assert [o.request_id for o in first] == [bad]
    out = first[0]
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"]
    assert out.error == (f"request {bad!r} cannot be scheduled: even with the engine idle it "
                         f"needs more KV-cache blocks, sequences or batched tokens than the engine "
                         f"has; aborted")
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(done) == [good] and done[good].error is None
    assert len(done[good].outputs[0].token_ids) == 2
    assert eng.kv_cache_stats().num_used_blocks == 0
