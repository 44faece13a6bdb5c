"""Llama 3.1's JSON tool calls: what Meta's own chat template writes for a call parses back to
exactly that call, whole and cut at every boundary; an answer that is not a call (plain text, a
JSON answer, bad JSON, an unknown function) is text; the forcing grammar admits exactly calls
of the tools, and what it admits parses back."""
import json

import pytest

from kvslim.tools.chat import fallback_messages
from kvslim.tools.plain_json import FORMAT, PYTHON_TAG
from tool_checks import (TIME, TOOLS, USER, WEATHER, accepts, assistant_turn, cuts,
                         family_tokenizer, lark, openai_calls, stream)



@pytest.fixture(scope="module")
def llama(hf_checkpoints):
    return family_tokenizer(hf_checkpoints["gqa"], "llama3.1_instruct.jinja",
                            {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})


def _turn(llama, name: str, arguments: dict) -> str:
    assistant = {"role": "assistant", "content": "",
                 "tool_calls": openai_calls([(name, arguments)], ["call_1"])}
    return assistant_turn(llama, USER, assistant, [t.openai() for t in TOOLS], FORMAT,
                          "<|eot_id|>")


def _parsed(text: str):
    content, calls = FORMAT.parse(text, TOOLS)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_the_templates_own_call_parses_back(llama):
    turn = _turn(llama, "get_weather", {"city": "Paris", "unit": "c"})
    assert turn == '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
    for text in (turn, PYTHON_TAG + turn, f"\n {PYTHON_TAG} {turn}\n"):
        assert _parsed(text) == (None, [("get_weather", {"city": "Paris", "unit": "c"})])


def test_calls_separated_by_semicolons(llama):
    # Meta's 3.1 template renders one call a turn; 3.2 and 3.3 answer several joined by ";".
    one = _turn(llama, "get_weather", {"city": "Paris"})
    two = _turn(llama, "get_time", {"tz": "Europe/Paris"})
    assert _parsed(f"{one}; {two}") == (None, [("get_weather", {"city": "Paris"}),
                                              ("get_time", {"tz": "Europe/Paris"})])
    assert _parsed(f"{one};{two}") == _parsed(f"{one}\n{two}") == _parsed(f"{one}; {two}")


def test_streamed_at_every_cut_equals_whole(llama):
    one = _turn(llama, "get_weather", {"city": "Paris"})
    two = _turn(llama, "get_time", {"tz": "CET"})
    for text in (f"{PYTHON_TAG}{one}; {two}", f"{one}; {two} and then words", "A plain answer.",
                 '{"name": "get_weather", "parameters": {"city": }}'):
        whole = stream(FORMAT, TOOLS, [text])
        assert whole[1] == [(c.name, c.arguments) for c in FORMAT.parse(text, TOOLS)[1]]
        for pieces in cuts(text):
            assert stream(FORMAT, TOOLS, pieces) == whole, pieces


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": }}',                 # bad JSON
    '{"name": "get_weather", "parameters": {"city": "Paris"}',           # never closed
    '{"name": "get_wether", "parameters": {"city": "Paris"}}',           # no such function
    '{"name": "get_weather", "parameters": "Paris"}',                     # arguments not an object
    ' {"city": "Paris", "temperature": 21}',                              # a JSON answer
    'Sure: {"name": "get_weather", "parameters": {"city": "Paris"}}',    # text first
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',        # not this format
])
def test_what_is_not_a_call_is_text(text):
    assert FORMAT.parse(text, TOOLS) == (text, [])


def test_a_call_then_text_keeps_both():
    text = '{"name": "get_time", "parameters": {"tz": "UTC"}} Checking the time.'
    assert _parsed(text) == ("Checking the time.", [("get_time", {"tz": "UTC"})])


def test_plain_text_streams_at_once_and_a_call_waits_for_its_end():
    parser = FORMAT.stream_parser(TOOLS)
    assert parser.feed("  ") == [] and parser.feed("Hel") == ["  Hel"] and parser.feed("lo") == \
        ["lo"]
    parser = FORMAT.stream_parser(TOOLS)
    assert parser.feed(PYTHON_TAG[:5]) == [] and parser.feed(PYTHON_TAG[5:]) == []
    assert parser.feed('{"name": "get_time", "parameters": {"tz": "UTC"}') == []
    [call] = parser.feed("}")
    assert (call.name, call.arguments) == ("get_time", '{"tz": "UTC"}')
    assert parser.finish() == []


@pytest.mark.parametrize("parallel", [False, True])
def test_the_forcing_grammar_admits_only_calls_and_they_parse_back(parallel):
    grammar = lark(FORMAT, TOOLS, parallel)
    one = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
    two = one + '; {"name": "get_time", "parameters": {"tz": "UTC"}}'
    assert accepts(grammar, one)
    assert accepts(grammar, two) == parallel
    assert _parsed(two) == (None, [("get_weather", {"city": "Oslo", "unit": "c"}),
                                   ("get_time", {"tz": "UTC"})])
    for bad in [one.replace("get_weather", "get_wether"),                # unknown function
                one.replace('"unit": "c"', '"unit": "k"'),              # outside the enum
                one.replace('{"city": "Oslo", "unit": "c"}', '{"unit": "c"}'),   # required
                one.replace('"unit": "c"', '"unit": "c", "extra": 1'),  # closed objects
                one.replace("parameters", "arguments"),                 # Hermes' key
                PYTHON_TAG + one, "Sure! " + one]:
        assert not accepts(grammar, bad), bad


def test_a_template_without_tools_gets_them_in_this_format():
    history = USER + [{"role": "assistant", "content": None, "tool_calls": openai_calls(
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})], ["a", "b"])},
        {"role": "tool", "tool_call_id": "a", "content": "21 C"}]
    system, user, assistant, result = fallback_messages(history, TOOLS, FORMAT)
    assert system["role"] == "system" and '"parameters": <arguments object>' in system["content"]
    assert json.dumps(WEATHER.openai(), indent=4) in system["content"]
    assert assistant == {"role": "assistant", "content":
                         '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                         '{"name": "get_time", "parameters": {"tz": "CET"}}'}
    assert user == USER[0] and result == {"role": "user",
                                          "content": "<tool_response>\n21 C\n</tool_response>"}
