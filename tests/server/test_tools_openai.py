"""Tool calls through the official openai client against `kvslim serve` on SmolLM2: forced calls
("required", a named function) whose arguments validate against the tool's schema, whole and
streamed (the client's stream helper reassembles the deltas); "auto" parsing the model's own
calls; a tool result in the history; finish_reason "tool_calls"."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}},
                   "required": ["tz"]}}}
CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert an amount between currencies",
    "parameters": {"type": "object", "properties": {
        "amount": {"type": "number", "minimum": 0},
        "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["amount", "from", "to"]}}}
TOOLS = [WEATHER, TIME, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Paris?", "What time is it in Tokyo?",
             "How many euros are 20 dollars?", "Is it raining in Oslo right now?",
             "Convert 5 GBP to JPY.", "What's the time in New York and the weather in Rome?"]


@pytest.fixture
def smol(smol_server):
    with openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="none", max_retries=0,
                       timeout=300) as c:
        yield c


def _assert_valid(calls, names):
    assert calls, "no tool call"
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


@pytest.mark.parametrize("question", QUESTIONS)
def test_required_always_yields_valid_calls(smol, question):
    r = smol.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                     tools=TOOLS, tool_choice="required", max_tokens=160,
                                     temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _assert_valid(choice.message.tool_calls, set(SCHEMAS))
    assert choice.message.content is None


def test_a_named_function_streamed_and_not(smol):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = smol.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                         tool_choice=named, parallel_tool_calls=False,
                                         max_tokens=100, temperature=0).choices[0]
    _assert_valid(whole.message.tool_calls, {"get_time"})
    assert len(whole.message.tool_calls) == 1
    with smol.chat.completions.stream(model="tiny", messages=messages, tools=TOOLS,
                                      tool_choice=named, parallel_tool_calls=False,
                                      max_tokens=100, temperature=0) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_parses_the_models_own_call_and_a_result_continues(smol):
    # Whatever the model would say, the regex makes its answer a Hermes call; "auto" parses it.
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>'
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    r = smol.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                     max_tokens=60, temperature=0,
                                     extra_body={"guided_regex": "Checking\\. " + call.replace(
                                         "{", "\\{").replace("}", "\\}")})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("get_time", {"tz": "Asia/Tokyo"})]
    history = messages + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id,
                           "content": "14:05"}]
    after = smol.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=30, temperature=0)
    assert after.choices[0].message.tool_calls == [] or after.choices[0].message.tool_calls is None
    assert after.choices[0].message.content


def test_streamed_auto_answer_without_calls_is_plain_text(smol):
    messages = [{"role": "user", "content": "Say hello."}]
    chunks = list(smol.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                               max_tokens=20, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = smol.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                         max_tokens=20, temperature=0).choices[0]
    assert text == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
