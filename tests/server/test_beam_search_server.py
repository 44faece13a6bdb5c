"""Beam search and best_of through the openai client: the server's choices are LLM.beam_search's
hypotheses, best first; best_of > n returns n choices."""
from kvslim.engine.sampling_params import SamplingParams


def test_completions_beam_search_equals_llm(client, reference):
    r = client.completions.create(model="tiny", prompt="It is a truth", max_tokens=8, n=2,
                                  temperature=0, extra_body={"use_beam_search": True,
                                                             "best_of": 4,
                                                             "length_penalty": 0.5,
                                                             "ignore_eos": True})
    expected = reference.generate("It is a truth", SamplingParams(
        use_beam_search=True, n=2, best_of=4, max_tokens=8, temperature=0, length_penalty=0.5,
        ignore_eos=True), use_tqdm=False)[0].outputs
    assert [c.text for c in r.choices] == [c.text for c in expected]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in expected)


def test_chat_beam_search_and_best_of(client):
    messages = [{"role": "user", "content": "the kernel"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                       extra_body={"use_beam_search": True, "best_of": 3,
                                                   "early_stopping": True})
    assert len(r.choices) == 1 and r.choices[0].message.content is not None
    r = client.completions.create(model="tiny", prompt="the kernel", max_tokens=6, n=2,
                                  best_of=5, temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1]
