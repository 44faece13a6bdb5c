"""Llama 3.1, 3.2 and 3.3's JSON tool calls: the answer is nothing but the call, a JSON object
{"name": ..., "parameters": {...}} — several separated by ";" — sometimes after the
`<|python_tag|>` token (the tokenizer's special token, so usually gone from the decoded text).
Meta's chat templates put the tools in the first user turn and render an earlier call the same
way. An answer that does not open with a call is text throughout; one whose JSON is not a call
of these tools (a JSON answer, bad JSON) is text too."""
from __future__ import annotations

import json
from typing import Any

from kvslim.tools.format import (Event, ToolFormat, arguments_of, call_of, call_schema,
                                 decode_json)
from kvslim.tools.spec import ToolSpec

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "
# Meta's templates say `Respond in the format {"name": function name, "parameters": dictionary
# of argument name and its value}`; 3.1 and 3.3 also write <|python_tag|> for built-in tools.
TEMPLATE_MARKERS = (PYTHON_TAG, '"parameters": dictionary of argument name')


# ---- rendering ---------------------------------------------------------------------------
def system_prompt(tools: list[ToolSpec]) -> str:
    listing = "\n\n".join(json.dumps(t.openai(), ensure_ascii=False, indent=4) for t in tools)
    return ("# Tools\n\nYou may call these functions to answer the user. To call a function, "
            "answer with JSON and nothing else, in the format {\"name\": <function name>, "
            "\"parameters\": <arguments object>}; separate several calls with \"; \". Do not "
            f"use variables.\n\n{listing}")


def call_text(name: str, arguments: Any) -> str:
    return json.dumps({"name": name, "parameters": arguments_of(arguments)}, ensure_ascii=False)


def history_text(calls: list[dict[str, Any]]) -> str:
    return SEPARATOR.join(call_text(c["function"]["name"], c["function"]["arguments"])
                          for c in calls)


# ---- parsing -----------------------------------------------------------------------------
class StreamParser:
    """Until the answer's first visible character is known, nothing is given out: `{` (or the
    python tag and then `{`) opens calls, anything else makes the whole answer text. Each call
    is given out once its object closes; what follows the calls that is not one is text."""

    def __init__(self, tools: list[ToolSpec]):
        self.names = {t.name for t in tools}
        self.pending = ""                 # text not given out yet
        self.state = "start"              # "start" (undecided), "calls" or "text"

    def feed(self, delta: str) -> list[Event]:
        self.pending += delta
        if self.state == "start":
            opening = _next_call(self.pending, 0, "")
            if opening is None:
                return []
            self.state = "text" if opening < 0 else "calls"
        return self._text() if self.state == "text" else self._calls()

    def finish(self) -> list[Event]:
        """At the end: what never became a call (an unclosed or bad object) is text."""
        return self._text()

    def _text(self) -> list[Event]:
        """From here on everything is text: what is pending, and every later delta."""
        self.state = "text"
        out, self.pending = self.pending, ""
        return [out] if out else []

    def _calls(self) -> list[Event]:
        events: list[Event] = []
        while True:
            i = _next_call(self.pending, 0, ";")
            if i is None:
                return events
            if i < 0:
                return events + self._text()
            decoded = decode_json(self.pending, i)
            if decoded is None:                              # not closed yet
                return events
            call = call_of(decoded[0], self.names, ("parameters", "arguments"))
            if call is None:
                return events + self._text()
            events.append(call)
            self.pending = self.pending[decoded[1]:]


def _next_call(text: str, i: int, separators: str) -> int | None:
    """Where the next call's `{` is, past blanks, `separators` and the python tag; -1 if
    something else comes first; None while that is not known yet."""
    while i < len(text) and (text[i].isspace() or text[i] in separators):
        i += 1
    if text.startswith(PYTHON_TAG, i):
        i += len(PYTHON_TAG)
        while i < len(text) and text[i].isspace():
            i += 1
    elif PYTHON_TAG.startswith(text[i:]):                    # nothing yet, or part of the tag
        return None
    if i == len(text):
        return None
    return i if text[i] == "{" else -1


# ---- forcing -----------------------------------------------------------------------------
def forcing_grammar(tools: list[ToolSpec], parallel: bool) -> str:
    """One call object — or several separated by "; " with `parallel` — as the templates
    render them: {"name": const, "parameters": <the tool's schema>}."""
    repeat = f' ("{SEPARATOR}" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f"call: %json {json.dumps(call_schema(tools, 'parameters'))}\n")


FORMAT = ToolFormat("plain_json", TEMPLATE_MARKERS, StreamParser, forcing_grammar,
                    system_prompt, history_text)
