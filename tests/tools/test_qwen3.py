"""Qwen2.5's and Qwen3's tool calls (`--tool-call-parser qwen3`): what their own chat templates
write for calls — after text, and after Qwen3's empty think block — parses back to exactly those
calls, whole and cut at every boundary; a block whose JSON is bad stays text."""
import json

import pytest

from kvslim.tools import hermes
from kvslim.tools.registry import FORMATS
from kvslim.tools.spec import ToolSpec
from tool_checks import assistant_turn, cuts, family_tokenizer, openai_calls, stream

FORMAT = FORMATS["qwen3"]
WEATHER = ToolSpec("get_weather", "weather", {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]})
TIME = ToolSpec("get_time", "time", {"type": "object", "properties": {"tz": {"type": "string"}},
                                     "required": ["tz"]})
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Paris, and the time there?"}]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
SPECIALS = {"eos_token": "<|im_end|>"}


def test_qwen3_speaks_hermes():
    assert FORMAT is hermes.FORMAT


def _turn(hf_checkpoints, template: str, content: str) -> str:
    tok = family_tokenizer(hf_checkpoints["gqa"], template, SPECIALS)
    assistant = {"role": "assistant", "content": content,
                 "tool_calls": openai_calls(CALLS, ["call_1", "call_2"])}
    return assistant_turn(tok, USER, assistant, [t.openai() for t in TOOLS], FORMAT,
                          "<|im_end|>\n")


@pytest.mark.parametrize("template, content, text, expected_content", [
    ("qwen2.5_instruct.jinja", "Let me check.", "Let me check.\n", "Let me check."),
    ("qwen2.5_instruct.jinja", "", "", None),
    # Qwen3 without a reasoning parser: its (empty) thinking is the answer's text.
    ("qwen3.jinja", "", "<think>\n\n</think>\n\n", "<think>\n\n</think>"),
])
def test_the_templates_own_calls_parse_back(hf_checkpoints, template, content, text,
                                            expected_content):
    turn = _turn(hf_checkpoints, template, content)
    assert turn == (f'{text}<tool_call>\n{{"name": "get_weather", "arguments": {{"city": '
                    f'"Paris"}}}}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": '
                    f'{{"tz": "Europe/Paris"}}}}\n</tool_call>')
    parsed_content, calls = FORMAT.parse(turn, TOOLS)
    assert (parsed_content, [(c.name, json.loads(c.arguments)) for c in calls]) == \
        (expected_content, CALLS)
    whole = stream(FORMAT, TOOLS, [turn])
    # Shown while streaming: the text before the calls, and the newline between them.
    assert whole == (text + "\n", [(c.name, c.arguments) for c in calls])
    for pieces in cuts(turn):
        assert stream(FORMAT, TOOLS, pieces) == whole, pieces


@pytest.mark.parametrize("body", ['{"name": "get_weather", "arguments": {"city": }}',
                                  '{"name": "get_weather", "arguments": "Paris"}',
                                  '{"name": "get_wether", "arguments": {"city": "Paris"}}'])
def test_a_block_that_is_not_a_call_is_text(body):
    text = f"<tool_call>\n{body}\n</tool_call>"
    assert FORMAT.parse(text, TOOLS) == (text, [])
