"""The server through the official `openai` client, sync and async, streaming and not,
completions and chat: greedy outputs equal the offline `LLM` on the same checkpoint."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from kvslim.engine.sampling_params import SamplingParams

PROMPTS = ["It is a truth universally acknowledged, that",
           "In the beginning God created",
           "The kernel schedules tasks; memory is"]
MAX_TOKENS = 12


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].object == "model"
    assert client.models.retrieve("tiny").id == "tiny"


def test_completions_batch_equals_llm_generate(client, reference):
    expected = reference.generate(PROMPTS, greedy(), use_tqdm=False)
    response = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice, out in zip(response.choices, expected):
        assert choice.text == out.outputs[0].text
        assert choice.finish_reason == out.outputs[0].finish_reason
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert response.usage.total_tokens == (response.usage.prompt_tokens
                                           + response.usage.completion_tokens)


def test_completions_stream_with_usage_and_token_ids(client, reference):
    ids = reference.tokenizer.encode(PROMPTS[1])
    expected = reference.generate([ids], greedy(), use_tqdm=False)[0]
    stream = client.completions.create(model="tiny", prompt=ids, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == expected.outputs[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        len(expected.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_chat_async_equals_llm_chat(async_client, reference):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": PROMPTS[0]}]
    expected = reference.chat(messages, greedy(), use_tqdm=False)[0].outputs[0]

    async def both():
        async with async_client() as c:
            full = await c.chat.completions.create(model="tiny", messages=messages,
                                                   max_tokens=MAX_TOKENS, temperature=0)
            stream = await c.chat.completions.create(model="tiny", messages=messages,
                                                     max_tokens=MAX_TOKENS, temperature=0,
                                                     stream=True)
            return full, [chunk async for chunk in stream]

    full, chunks = asyncio.run(both())
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected.text
    assert full.choices[0].finish_reason == expected.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_chat_sync_stream_and_max_completion_tokens(client, reference):
    messages = [{"role": "user", "content": PROMPTS[2]}]
    expected = reference.chat(messages, greedy(5), use_tqdm=False)[0].outputs[0]
    stream = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                            max_completion_tokens=5, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == expected.text


def test_completions_async_stream_equals_llm(async_client, reference):
    expected = reference.generate(PROMPTS[2], greedy(), use_tqdm=False)[0].outputs[0]

    async def run():
        async with async_client() as c:
            stream = await c.completions.create(model="tiny", prompt=PROMPTS[2],
                                                max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])

    assert asyncio.run(run()) == expected.text


def test_n_and_seed_give_numbered_reproducible_choices(client):
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=1.0, n=3, seed=7)
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    batch = client.completions.create(**{**kw, "prompt": PROMPTS[:2], "n": 2})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]


def test_stop_string_cuts_the_text(client, reference):
    full = reference.generate(PROMPTS[0], greedy(20, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), "the greedy output should have text to stop on"
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20,
                                         temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[:text.find(stop)]


def test_echo_and_logprobs(client):
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPTS[1])
    scored = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4,
                                       temperature=0, logprobs=2)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == scored.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3 and top[token] == logprob
        assert max(top.values()) == logprob                       # greedy: the best one


def test_echo_with_logprobs_scores_the_prompt(client, reference):
    """lm-eval-harness's loglikelihood request: echo + logprobs returns every prompt token's
    logprob (the first is null), equal to the offline engine's prompt_logprobs."""
    expected = reference.generate([PROMPTS[0]], greedy(1, logprobs=1, prompt_logprobs=1),
                                  use_tqdm=False)[0]
    n = len(expected.prompt_token_ids)
    wanted = [e.logprob for e in expected.prompt_logprobs[1:]] + \
        [expected.outputs[0].logprobs[0].logprob]
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=1, temperature=0, echo=True,
              logprobs=1)
    response = client.completions.create(**kw)
    choice = response.choices[0]
    assert choice.text == PROMPTS[0] + expected.outputs[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(wanted, abs=1e-4)
    assert all(len(top) in (1, 2) for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [x for chunk in chunks for c in chunk.choices if c.logprobs
                for x in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(wanted, abs=1e-4)


def test_logit_bias_reaches_the_sampler(client, reference):
    forced = reference.tokenizer.encode(" the")[-1]
    response = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=5,
                                         temperature=0, logit_bias={str(forced): 100})
    assert response.choices[0].text == reference.tokenizer.decode([forced] * 5)


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_tokenize_and_detokenize(server, reference):
    with httpx.Client(base_url=server.url, headers=server.headers) as http:
        tokens = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
        assert tokens["tokens"] == reference.tokenizer.encode(PROMPTS[0])
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert text == PROMPTS[0]
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.json()["tokens"] == reference.tokenizer.encode_chat(
            [{"role": "user", "content": "hi"}])


def test_tokenize_counts_a_chat_prompt_as_the_chat_request_renders_it(server, client):
    """With tools (rendered into the prompt), the count is the chat request's prompt_tokens."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with httpx.Client(base_url=server.url, headers=server.headers) as http:
        plain = http.post("/tokenize", json={"messages": messages}).json()["count"]
        counted = http.post("/tokenize", json={"messages": messages, "tools": tools}).json()
    used = client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                          max_tokens=1).usage.prompt_tokens
    assert counted["count"] == used > plain


def test_sampling_extras_reach_the_engine(client, reference):
    """top_k=1 samples the argmax whatever the temperature; penalties change greedy output."""
    expected = reference.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].outputs[0].text
    top1 = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                     temperature=1.5, seed=3, extra_body={"top_k": 1})
    assert top1.choices[0].text == expected
    penalised = reference.generate(PROMPTS[0], greedy(frequency_penalty=2.0,
                                                      repetition_penalty=1.5),
                                   use_tqdm=False)[0].outputs[0].text
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                         temperature=0, frequency_penalty=2.0,
                                         extra_body={"repetition_penalty": 1.5})
    assert response.choices[0].text == penalised


def test_usage_reports_prompt_tokens_served_by_the_prefix_cache(client, reference):
    """The second request with the same long prompt reads its full blocks from the prefix
    cache: usage.prompt_tokens_details.cached_tokens counts them, in plain, streamed and chat
    answers; the first counts none."""
    prompt = " ".join(f"cached-prefix {i}" for i in range(20))
    n = len(reference.tokenizer.encode(prompt))
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    block = 16                                   # the engine's default block size
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // block * block
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    usage = list(stream)[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == (n - 1) // block * block
    messages = [{"role": "user", "content": prompt}]
    chat = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           temperature=0) for _ in range(2)]
    assert chat[0].usage.prompt_tokens_details.cached_tokens < chat[0].usage.prompt_tokens
    assert chat[1].usage.prompt_tokens_details.cached_tokens == \
        (chat[1].usage.prompt_tokens - 1) // block * block > 0
