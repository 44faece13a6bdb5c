"""The reasoning parsers: what a whole answer splits into, per convention, and the same split
however a stream cuts the answer (every cut point, every pair of cut points)."""
from __future__ import annotations

import pytest

from kvslim.errors import ConfigError
from kvslim.reasoning.parser import ReasoningStream
from kvslim.tools.registry import reasoning_format

CASES = {
    # text: (deepseek_r1, qwen3)
    "Let me think.</think>The answer is 4.": (("Let me think.", "The answer is 4."),
                                               (None, "Let me think.</think>The answer is 4.")),
    "<think>\nadd 2 and 2\n</think>\n\n4": (("\nadd 2 and 2\n", "\n\n4"),
                                           ("\nadd 2 and 2\n", "\n\n4")),
    "  <think>x</think>y": (("x", "y"), ("x", "y")),
    "<think>cut off by the budget": (("cut off by the budget", None),
                                     ("cut off by the budget", None)),
    "still thinking": (("still thinking", None), (None, "still thinking")),
    "<thin": (("<thin", None), (None, "<thin")),
    "": ((None, None), (None, None)),
    "a</think>b</think>c": (("a", "b</think>c"), (None, "a</think>b</think>c")),
    "<think></think>": ((None, None), (None, None)),
}


@pytest.mark.parametrize("name, which", [("deepseek_r1", 0), ("qwen3", 1)])
@pytest.mark.parametrize("text", list(CASES))
def test_split(name, which, text):
    assert reasoning_format(name).split(text) == CASES[text][which]


def _streamed(fmt, pieces):
    stream = ReasoningStream(fmt)
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    reasoning, content = ("".join(p[i] for p in parts) for i in (0, 1))
    return reasoning or None, content or None


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", list(CASES))
def test_any_cuts_give_the_whole_split(name, text):
    fmt = reasoning_format(name)
    whole = fmt.split(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _streamed(fmt, [text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert _streamed(fmt, list(text)) == whole


def test_unknown_parser_is_refused():
    with pytest.raises(ConfigError, match="unknown reasoning parser 'r2'"):
        reasoning_format("r2")
    assert reasoning_format(None) is None
