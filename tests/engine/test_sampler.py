"""Sampler on hand-made logits: filters, penalties, min_tokens, logprobs, seeds."""
import math

import pytest
import torch

from kvslim.engine.sampler import SampleRequest, Sampler, filter_probs
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.sequence import Sequence
from kvslim.errors import InvalidRequestError

PROBS = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
LOGITS = PROBS.log()


def req(prompt=(1,), outputs=(), name="r", **params):
    s = Sequence(request_id=name, token_ids=list(prompt) + list(outputs),
                 params=SamplingParams(**params), block_size=4, num_prompt_tokens=len(prompt))
    return SampleRequest(s)


def sampler(vocab=4, eos=(3,)):
    return Sampler(vocab, torch.device("cpu"), eos, seed=0)


def test_top_k_keeps_the_k_best():
    probs = filter_probs(LOGITS, top_k=[2], top_p=[1.0], min_p=[0.0])
    torch.testing.assert_close(probs, torch.tensor([[0, 0, 3 / 7, 4 / 7]]))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = filter_probs(LOGITS, top_k=[0], top_p=[0.5], min_p=[0.0])
    torch.testing.assert_close(probs, torch.tensor([[0, 0, 3 / 7, 4 / 7]]))
    probs = filter_probs(LOGITS, top_k=[0], top_p=[0.4], min_p=[0.0])   # 0.4 alone reaches it
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0, 0, 1]]))


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = filter_probs(LOGITS, top_k=[0], top_p=[1.0], min_p=[0.45])   # keep p >= 0.18
    torch.testing.assert_close(probs, torch.tensor([[0, 2 / 9, 3 / 9, 4 / 9]]))


def test_filters_are_per_row():
    probs = filter_probs(LOGITS.repeat(3, 1), top_k=[1, 0, 0], top_p=[1.0, 1.0, 0.5],
                         min_p=[0.0, 0.0, 0.0])
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0, 0, 1]))
    torch.testing.assert_close(probs[1], PROBS[0])
    torch.testing.assert_close(probs[2], torch.tensor([0, 0, 3 / 7, 4 / 7]))


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5]])
    s = sampler()
    r = req(prompt=(0, 1), repetition_penalty=2.0, temperature=0)
    out = s._apply_penalties(logits.clone(), [r])
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 1.5, 0.5]]))
    assert s([logits][0], [r])[0][0].token_id == 2        # 1.5 now beats the halved 2.0


def test_presence_and_frequency_penalties_use_output_counts():
    logits = torch.zeros(1, 4)
    r = req(prompt=(3,), outputs=(1, 1, 2), presence_penalty=0.5, frequency_penalty=0.25)
    out = sampler()._apply_penalties(logits, [r])
    # token 1: seen twice -> 0.5 + 2*0.25; token 2: once -> 0.5 + 0.25; prompt token 3: none
    torch.testing.assert_close(out, torch.tensor([[0.0, -1.0, -0.75, 0.0]]))


def test_penalty_state_follows_new_tokens():
    s = sampler()
    r = req(prompt=(3,), frequency_penalty=1.0, temperature=0)
    logits = torch.tensor([[0.0, 0.9, 0.0, 0.0]])
    assert s(logits, [r])[0][0].token_id == 1
    r.seq.token_ids.append(1)
    assert s(logits, [r])[0][0].token_id == 0             # 0.9 - 1.0 < 0


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 1.0, 0.0, 5.0]])         # EOS (3) is the best
    s = sampler()
    early = req(min_tokens=2, temperature=0, stop_token_ids=[1])
    assert s(logits, [early])[0][0].token_id in (0, 2)
    late = req(outputs=(2, 2), min_tokens=2, temperature=0)
    assert s(logits, [late])[0][0].token_id == 3


def test_logprobs_are_the_raw_distribution():
    s = sampler()
    r = req(temperature=0, logprobs=2)
    res = s(LOGITS, [r])[0][0]
    assert res.token_id == 3
    assert math.isclose(res.logprob.logprob, math.log(0.4), rel_tol=1e-5)
    assert [t for t, _ in res.logprob.top] == [3, 2]
    assert math.isclose(res.logprob.top[1][1], math.log(0.3), rel_tol=1e-5)


def test_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))

    def draws(batch_extra: int) -> list[int]:
        s = sampler(vocab=50)
        target = req(name="t", seed=1234)
        out = []
        for _ in range(20):
            others = [req(name=f"o{i}") for i in range(batch_extra)]
            batch = others[:1] + [target] + others[1:]
            rows = logits.repeat(len(batch), 1)
            out.append(s(rows, batch)[min(1, len(others))][0].token_id)
        return out

    alone = draws(0)
    assert alone == draws(3) == draws(7)
    assert len(set(alone)) > 3                             # it really samples


def test_samples_follow_the_filtered_distribution():
    s = sampler()
    rs = [req(name=f"r{i}", top_k=2, seed=i) for i in range(400)]
    tokens = [res[0].token_id for res in s(LOGITS.repeat(400, 1), rs)]
    assert set(tokens) == {2, 3}
    assert 0.45 < tokens.count(3) / 400 < 0.70               # expected 4/7 = 0.57


def test_n_samples_from_one_row_differ_by_index():
    s = sampler(vocab=50)
    logits = torch.zeros(1, 50)
    r = SampleRequest(req(seed=5).seq, num_samples=4)
    tokens = [x.token_id for x in s(logits, [r])[0]]
    assert len(tokens) == 4 and len(set(tokens)) > 1


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -3), ("temperature", -0.1), ("top_p", 0.0),
    ("top_p", 1.5), ("n", 0), ("top_k", -2), ("min_p", 1.5), ("logprobs", 21),
    ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("stop", [""]),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and field in str(err.value)


def test_logit_bias_shifts_only_its_row_and_tokens():
    s = sampler()
    logits = LOGITS.repeat(2, 1)
    biased = req(temperature=0.0, logit_bias={0: 5.0}, logprobs=1)
    plain = req(name="p", temperature=0.0, logprobs=1)
    (b,), (p,) = s(logits, [biased, plain])
    assert b.token_id == 0 and p.token_id == 3         # log 0.1 + 5 beats log 0.4
    assert b.logprob.logprob == pytest.approx(math.log(0.1))    # logprobs stay raw
    (b,), = s(LOGITS, [req(temperature=0.0, logit_bias={3: -100})])
    assert b.token_id == 2                             # -100 bans the best token


@pytest.mark.parametrize("bias", [{-1: 1.0}, {1: 100.5}, {1: "x"}, {1.5: 1.0}])
def test_bad_logit_bias_names_the_field(bias):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias"


@pytest.mark.parametrize("what", [dict(), dict(logprobs=2), dict(logit_bias={3: -100.0}),
                                  dict(repetition_penalty=1.5), dict(min_tokens=2),
                                  dict(temperature=0.7, seed=1)])
def test_a_plain_greedy_batch_takes_the_argmax_and_any_processing_still_applies(what):
    """Greedy rows nothing processes skip the float32 copy: the argmax, ties to the first
    index; a row that asks for anything (bias, penalties, min_tokens, logprobs, sampling)
    takes the whole path, and the plain rows beside it keep their argmax."""
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0], [3.0, 0.0, 0.0, 4.0]], dtype=torch.bfloat16)
    s = sampler()
    plain, other = req(name="a", temperature=0), req(name="b", **{"temperature": 0, **what})
    assert s._plain_greedy([plain, other]) == (not what)
    out = s(logits, [plain, other])
    assert out[0][0].token_id == 1                      # the tie goes to the first index
    if not what:
        assert out[1][0].token_id == 3 and out[1][0].logprob is None
    if "logit_bias" in what or "min_tokens" in what:    # eos (3) banned or pushed down
        assert out[1][0].token_id == 0
