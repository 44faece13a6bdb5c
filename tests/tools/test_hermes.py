"""The Hermes format: whole and streamed parsing agree for every way of cutting the text; the
forcing grammar admits exactly the calls the tools' schemas allow."""
import json

import llguidance
import pytest
from hypothesis import given, settings, strategies as st

from kvslim.tools import hermes
from tool_checks import TIME, TOOLS, WEATHER
from tool_checks import accepts as _accepts


ANSWER = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}'
          '\n</tool_call> <tool_call>{"name": "nope", "arguments": {}}</tool_call> a < b')


def test_parse_finds_the_calls_and_keeps_the_rest_as_text():
    content, calls = hermes.parse(ANSWER, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert content.startswith("Let me check.")
    assert '"nope"' in content and content.endswith("a < b")     # an unknown function is text
    assert len({c.id for c in calls}) == 2


def test_no_calls_and_an_unclosed_call_are_text():
    assert hermes.parse("plain answer", TOOLS) == ("plain answer", [])
    content, calls = hermes.parse('<tool_call>\n{"name": "get_time"', TOOLS)
    assert calls == [] and content == '<tool_call>\n{"name": "get_time"'


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(ANSWER)), max_size=12))
def test_streamed_parsing_equals_whole_parsing(cuts):
    bounds = [0] + sorted(cuts) + [len(ANSWER)]
    parser = hermes.StreamParser(TOOLS)
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += parser.feed(ANSWER[a:b])
    events += parser.finish()
    text = "".join(e for e in events if isinstance(e, str))
    calls = [(e.name, e.arguments) for e in events if not isinstance(e, str)]
    content, whole = hermes.parse(ANSWER, TOOLS)
    assert text.strip() == content
    assert calls == [(c.name, c.arguments) for c in whole]


@pytest.mark.parametrize("parallel", [False, True])
def test_the_forcing_grammar_admits_only_valid_calls(parallel):
    grammar = llguidance.LLMatcher.grammar_from_lark(hermes.forcing_grammar(TOOLS, parallel))
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert _accepts(grammar, one)
    assert _accepts(grammar, two) == parallel
    for bad in [one.replace("get_weather", "get_wether"),              # unknown function
                one.replace('"unit": "c"', '"unit": "k"'),            # outside the enum
                one.replace('{"city": "Oslo", "unit": "c"}', '{"unit": "c"}'),   # required
                one.replace('"unit": "c"', '"unit": "c", "extra": 1'),  # closed objects
                "Sure! " + one]:
        assert not _accepts(grammar, bad), bad
