"""tools and tool_choice: what is accepted, and errors that name the field."""
import pytest

from kvslim.errors import InvalidRequestError
from kvslim.tools.chat import ToolRequest

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("tools, choice, param, message", [
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools", "name"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools", "name"),
    ([{"type": "retrieval"}], None, "tools", "type 'function'"),
    ([TOOL, TOOL], None, "tools", "defined twice"),
    ([{"type": "function", "function": {"name": "g", "parameters": []}}], None, "tools",
     "JSON schema object"),
    ([TOOL], {"type": "function", "function": {"name": "g"}}, "tool_choice", "'g'.*among"),
    ([TOOL], "sometimes", "tool_choice", "one of none, auto, required"),
    (None, "required", "tool_choice", "needs tools"),
    ([TOOL], {"type": "function"}, "tool_choice", "named tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, param, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        ToolRequest.of(tools, choice)
    assert e.value.param == param


def test_defaults_follow_openai():
    assert ToolRequest.of([TOOL], None).choice.mode == "auto"
    assert ToolRequest.of(None, None).choice.mode == "none"
    named = ToolRequest.of([TOOL], {"type": "function", "function": {"name": "f"}})
    assert named.choice.forced and named.forcing().param == "tool_choice"
    assert ToolRequest.of([TOOL], "auto").forcing() is None
    assert ToolRequest.of([TOOL], "none").parse('<tool_call>{"name": "f"}</tool_call>')[1] == []
