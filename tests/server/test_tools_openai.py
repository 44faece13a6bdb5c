"""Tool calls through the official openai client against `kvslim serve` on SmolLM2: forced calls
("required", a named function) whose arguments validate against the tool's schema, whole and
streamed (the client's stream helper reassembles the deltas); "auto" parsing the model's own
calls; a tool result in the history; finish_reason "tool_calls". Then the same behind Llama
3.1's, Mistral's and Qwen3's own chat templates, each family's format chosen by
--tool-call-parser (auto or named): tool_choice none, auto, required and named, and the next
turn rendered by the family's template."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer

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


def _assert_valid(calls, names, id_pattern="call_[0-9a-f]{24}"):
    assert calls, "no tool call"
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert re.fullmatch(id_pattern, call.id) and call.type == "function"


def _assert_streamed_as_whole(client, whole, **kwargs) -> None:
    """The same request streamed (the client's helper reassembles the deltas) makes the same
    calls as `whole`, and finishes with "tool_calls"."""
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


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
    _assert_streamed_as_whole(smol, whole, model="tiny", messages=messages, tools=TOOLS,
                              tool_choice=named, parallel_tool_calls=False, max_tokens=100,
                              temperature=0)


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


# ---- the other families' formats ---------------------------------------------------------
# SmolLM2 behind each family's own chat template (tests/tools/templates/): the template lays out
# the tools and the history, the server reads calls in the family's format.
TEMPLATES = Path(__file__).parents[1] / "tools" / "templates"
FAMILIES = {"llama3_json": ("llama3.1_instruct.jinja", "auto"),      # --tool-call-parser
            "mistral": ("mistral_v0.3_instruct.jinja", "auto"),
            "qwen3": ("qwen3.jinja", "qwen3")}
# What each family's model writes to call get_time, as its template renders a call.
TIME_CALL = {
    "llama3_json": '{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]',
    "qwen3": '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>'}
# How its template renders the result of call {id} on the next turn (Meta's writes any string
# result as JSON: in Jinja a string is iterable).
RESULT_TEXT = {"llama3_json": '<|start_header_id|>ipython<|end_header_id|>\n\n"14:05"<|eot_id|>',
               "mistral": '[TOOL_RESULTS] {{"content": 14:05, "call_id": "{id}"}}[/TOOL_RESULTS]',
               "qwen3": "\n<tool_response>\n14:05\n</tool_response>"}
CALL_IDS = {"llama3_json": "call_[0-9a-f]{24}", "mistral": "[A-Za-z0-9]{9}",
            "qwen3": "call_[0-9a-f]{24}"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, smollm2_dir, tmp_path_factory):
    """(the format's name, a client, the server's URL): `kvslim serve` on SmolLM2 with the
    family's chat template in place of its own."""
    name = request.param
    template, parser = FAMILIES[name]
    model = tmp_path_factory.mktemp(f"smol-{name}")
    for f in smollm2_dir.iterdir():
        if f.name != "chat_template.jinja":
            (model / f.name).symlink_to(f)
    (model / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    live = LiveServer(model, tmp_path_factory.mktemp("logs") / f"{name}.log", "--kv-cache-memory",
                      "512MiB", "--threads", "2", "--tool-call-parser", parser)
    try:
        live.wait_healthy(timeout=300)
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0,
                           timeout=300) as client:
            yield name, client, live.url
    finally:
        assert live.terminate() == 0, live.logs()


def _regex(text: str) -> str:
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def test_family_required_and_named_calls(family):
    name, client, _ = family
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    required = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                              tool_choice="required", max_tokens=160,
                                              temperature=0).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content is None
    _assert_valid(required.message.tool_calls, set(SCHEMAS), CALL_IDS[name])
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model="tiny", messages=messages, tools=TOOLS, tool_choice=named,
                  parallel_tool_calls=False, max_tokens=100, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    _assert_valid(whole.message.tool_calls, {"get_time"}, CALL_IDS[name])
    assert len(whole.message.tool_calls) == 1
    _assert_streamed_as_whole(client, whole, **kwargs)


def test_family_auto_reads_its_own_call_and_the_template_renders_the_result(family):
    name, client, url = family
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    kwargs = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=60, temperature=0,
                  extra_body={"guided_regex": _regex(TIME_CALL[name])})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in whole.message.tool_calls] == [("get_time", {"tz": "Asia/Tokyo"})]
    _assert_valid(whole.message.tool_calls, {"get_time"}, CALL_IDS[name])
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    # No text was streamed: only the role chunk's empty content.
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == ""
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    call_id = whole.message.tool_calls[0].id
    history = messages + [whole.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call_id, "content": "14:05"}]
    tokens = httpx.post(f"{url}/tokenize", json={"messages": history, "tools": TOOLS},
                        timeout=60).json()["tokens"]
    prompt = httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=60).json()
    assert RESULT_TEXT[name].format(id=call_id) in prompt["prompt"]
    after = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                           tool_choice="none", max_tokens=20,
                                           temperature=0).choices[0]
    assert not after.message.tool_calls and after.finish_reason in ("stop", "length")


def test_family_none_leaves_a_call_as_text_and_plain_answers_stream(family):
    name, client, _ = family
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    none = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=60,
        temperature=0, extra_body={"guided_regex": _regex(TIME_CALL[name])}).choices[0]
    assert (none.message.content, none.message.tool_calls, none.finish_reason) == \
        (TIME_CALL[name], [], "stop")
    hello = [{"role": "user", "content": "Say hello."}]
    chunks = list(client.chat.completions.create(model="tiny", messages=hello, tools=TOOLS,
                                                 max_tokens=20, temperature=0, stream=True))
    whole = client.chat.completions.create(model="tiny", messages=hello, tools=TOOLS,
                                           max_tokens=20, temperature=0).choices[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
