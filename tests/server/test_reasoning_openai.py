"""--reasoning-parser through the official openai client against an in-process server whose
engine answers a scripted text (what a thinking model writes, in pieces): chat messages and
stream deltas carry the thinking as reasoning_content and the rest as content, tool calls are
read from the answer only, and /v1/responses lists a reasoning item before the message — whole
and streamed alike."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from inproc_server import serve_in_thread
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvslim.server.app import build_app
from kvslim.server.async_engine import AsyncEngine, RequestStream
from kvslim.server.context import ServerOptions

THINKING = "<think>\nThe user wants 2 + 2.\n</think>\n\nThe answer is 4."
CALLING = ('Paris needs a lookup.</think><tool_call>\n{"name": "get_weather", "arguments": '
           '{"city": "Paris"}}\n</tool_call>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def scripted(text: str, cut: int = 3):
    """AsyncEngine.add answering `text` in pieces of `cut` characters."""
    async def add(self, request_ids, prompts, params):
        stream = RequestStream(request_ids)
        pieces = [text[i:i + cut] for i in range(0, len(text), cut)] or [""]
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            so_far = "".join(pieces[:n + 1])
            c = CompletionOutput(0, so_far, [1] * (n + 1) if last else None,
                                 "stop" if last else None, delta_text=piece,
                                 delta_token_ids=[1])
            stream.put((0, RequestOutput(request_ids[0], None, [1, 2, 3], [c], last,
                                         RequestMetrics(0.0))))
        return stream
    return add


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(tiny_model, EngineConfig(kv_cache_memory="4MiB", dtype="float32",
                                              device="cpu"))


def serve(engine, monkeypatch, parser: str | None, text: str):
    monkeypatch.setattr(AsyncEngine, "add", scripted(text))
    return serve_in_thread(build_app(engine, "tiny", options=ServerOptions(
        reasoning_parser=parser)))


def chat(url, stream=False, **kw):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    return client.chat.completions.create(model="tiny", stream=stream, messages=[
        {"role": "user", "content": "2 + 2?"}], **kw)


@pytest.mark.parametrize("parser, reasoning, content", [
    ("deepseek_r1", "\nThe user wants 2 + 2.\n", "\n\nThe answer is 4."),
    ("qwen3", "\nThe user wants 2 + 2.\n", "\n\nThe answer is 4."),
    (None, None, THINKING)])
def test_chat_splits_reasoning_whole_and_streamed(engine, monkeypatch, parser, reasoning,
                                                   content):
    with serve(engine, monkeypatch, parser, THINKING) as url:
        message = chat(url).choices[0].message
        assert getattr(message, "reasoning_content", None) == reasoning
        assert message.content == content
        chunks = list(chat(url, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert (streamed or None) == reasoning
    assert "".join(d.content or "" for d in deltas) == content


def test_deepseek_r1_reads_an_answer_without_the_end_as_all_reasoning(engine, monkeypatch):
    with serve(engine, monkeypatch, "deepseek_r1", "still thinking about it") as url:
        message = chat(url).choices[0].message
    assert message.reasoning_content == "still thinking about it" and message.content is None


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_read_from_the_answer_only(engine, monkeypatch, stream):
    with serve(engine, monkeypatch, "deepseek_r1", CALLING) as url:
        answer = chat(url, stream=stream, tools=[WEATHER])
        if not stream:
            message = answer.choices[0].message
            calls, reasoning = message.tool_calls, message.reasoning_content
        else:
            deltas = [c.choices[0].delta for c in answer if c.choices]
            calls = [t for d in deltas for t in d.tool_calls or []]
            reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "Paris needs a lookup."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]


def test_responses_list_a_reasoning_item_before_the_message(engine, monkeypatch):
    with serve(engine, monkeypatch, "qwen3", THINKING) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        whole = client.responses.create(model="tiny", input="2 + 2?")
        events = list(client.responses.create(model="tiny", input="2 + 2?", stream=True))
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "\nThe user wants 2 + 2.\n"
    assert whole.output_text == "\n\nThe answer is 4."
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == whole.output[0].content[0].text
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output_text == whole.output_text
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index(
        "response.output_text.delta")


NUMBER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
NUMBER_FORMAT = {"type": "json_schema", "json_schema": {"name": "number", "schema": NUMBER}}


def serve_engine(engine, parser: str):
    return serve_in_thread(build_app(engine, "tiny", options=ServerOptions(
        reasoning_parser=parser)))


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_binds_the_answer_after_the_thinking(engine, stream):
    """The tiny random model thinks its own text until the budget asks for the answer: the
    thinking is returned apart, the content validates."""
    with serve_engine(engine, "deepseek_r1") as url:
        answer = chat(url, stream=stream, max_tokens=60, temperature=0,
                      response_format=NUMBER_FORMAT)
        if not stream:
            message = answer.choices[0].message
            reasoning, content = message.reasoning_content, message.content
        else:
            deltas = [c.choices[0].delta for c in answer if c.choices]
            reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
            content = "".join(d.content or "" for d in deltas)
    assert reasoning and "</think>" not in reasoning
    jsonschema.validate(json.loads(content), NUMBER)


def test_responses_bind_the_output_text_after_the_reasoning_item(engine):
    with serve_engine(engine, "deepseek_r1") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        whole = client.responses.create(model="tiny", input="2 + 2?", max_output_tokens=60,
                                        temperature=0, text={"format": {
                                            "type": "json_schema", "name": "number",
                                            "schema": NUMBER}})
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    jsonschema.validate(json.loads(whole.output_text), NUMBER)


def test_a_budget_that_cannot_end_the_thinking_is_a_400(engine):
    with serve_engine(engine, "deepseek_r1") as url:
        with pytest.raises(openai.BadRequestError, match="end the thinking") as e:
            chat(url, max_tokens=8, response_format=NUMBER_FORMAT)
    assert e.value.body["param"] == "max_tokens"
