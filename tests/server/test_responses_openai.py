"""POST /v1/responses through the official openai client against a live server on a tiny
random checkpoint: at temperature 0 the text is the chat completion of the same messages
(string input, message lists, instructions, a previous response's conversation, function
calls and their outputs); the event stream carries the same text and items; the budget marks
a response incomplete; text.format and forced tool calls; usage; errors name the field."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY

GREEDY = {"temperature": 0, "max_output_tokens": 12}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}


def chat_text(client, messages, max_tokens=12, **kw) -> str:
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                       temperature=0, **kw)
    return r.choices[0].message.content


def test_string_input_equals_the_chat_completion(client):
    r = client.responses.create(model="tiny", input="The capital of France is", **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == chat_text(client, [{"role": "user",
                                                "content": "The capital of France is"}])
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"


def test_instructions_and_message_items_equal_the_chat_completion(client):
    items = [{"role": "user", "content": "Hello"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hi there"}]},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Tell me "},
                          {"type": "input_text", "text": "a story"}]}]
    r = client.responses.create(model="tiny", input=items, instructions="Be brief.", **GREEDY)
    expected = chat_text(client, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hello"},
                                  {"role": "assistant", "content": "Hi there"},
                                  {"role": "user", "content": "Tell me a story"}])
    assert r.output_text == expected
    assert r.instructions == "Be brief."


def test_budget_makes_an_incomplete_response_with_usage(client):
    r = client.responses.create(model="tiny", input="Count: one two three", temperature=0,
                                max_output_tokens=3)
    chat = client.chat.completions.create(model="tiny", max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": "Count: one two three"}])
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    again = client.responses.create(model="tiny", input="Count: one two three", temperature=0,
                                    max_output_tokens=3)
    assert again.usage.input_tokens_details.cached_tokens == \
        (r.usage.input_tokens - 1) // 16 * 16


def test_stream_events_carry_the_same_text_and_response(client):
    whole = client.responses.create(model="tiny", input="Once upon a time", **GREEDY)
    events = list(client.responses.create(model="tiny", input="Once upon a time", stream=True,
                                          **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.id == events[0].response.id
    assert final.output[0].id == events[2].item.id
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_previous_response_continues_the_conversation(client):
    first = client.responses.create(model="tiny", input="My name is Ada.", **GREEDY)
    second = client.responses.create(model="tiny", input="What is my name?",
                                     previous_response_id=first.id, **GREEDY)
    assert second.previous_response_id == first.id
    assert second.output_text == chat_text(client, [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_an_unstored_response_cannot_be_continued(client):
    r = client.responses.create(model="tiny", input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="Again", previous_response_id=r.id,
                                **GREEDY)
    assert e.value.body["param"] == "previous_response_id"


def test_json_schema_format_parses(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "tag": {"enum": ["a", "b"]}},
              "required": ["n", "tag"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="A JSON object please", temperature=0,
                                max_output_tokens=40, text={"format": {
                                    "type": "json_schema", "name": "thing", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.fixture
def smol(smol_server):
    with openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="none", max_retries=0,
                       timeout=300) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_is_a_function_call_item(smol, stream):
    """On SmolLM2 (a random model's forced call may not close within a small budget)."""
    kw = dict(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
              temperature=0, max_output_tokens=80)
    if not stream:
        calls = [i for i in smol.responses.create(**kw).output if i.type == "function_call"]
    else:
        events = list(smol.responses.create(stream=True, **kw))
        calls = [e.item for e in events if e.type == "response.output_item.done"
                 and e.item.type == "function_call"]
        args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert args == [c.arguments for c in calls]
        assert [c.id for c in calls] == [c.id for c in events[-1].response.output
                                         if c.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_")
                         for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])


def test_function_call_items_equal_chat_tool_history(smol):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21C"}]
    r = smol.responses.create(model="tiny", input=items, tools=[WEATHER], **GREEDY)
    chat_tools = [{"type": "function", "function": {k: WEATHER[k] for k in (
        "name", "description", "parameters")}}]
    assert r.output_text == chat_text(smol, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}], tools=chat_tools)


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "bad name!",
                                        "schema": {}}}}, "text"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", **body},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_a_stored_response_route_allows_get_and_delete(server):
    r = httpx.put(f"{server.url}/v1/responses/resp_x",
                  headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "DELETE"}
