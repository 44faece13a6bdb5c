"""The Hermes tool-call format: each call a JSON object {"name": ..., "arguments": {...}} between
`<tool_call>` and `</tool_call>` lines. Qwen2, Qwen2.5, Qwen3 and the Hermes models are trained on
it and their chat templates render the tools themselves; for a template that does not render
tools (SmolLM2's, Gemma 3's), kvslim describes them in this format in a system message
(tools/chat.py). Also here: the parser of whole answers and of streamed ones, and the grammar
that forces calls for tool_choice "required" or a named function."""
from __future__ import annotations

import json
from typing import Any

from kvslim.reasoning.parser import partial_suffix
from kvslim.tools.format import (Event, ToolFormat, arguments_of, call_of, call_schema,
                                 parse_whole)
from kvslim.tools.spec import ToolCall, ToolSpec

START, END = "<tool_call>", "</tool_call>"


# ---- rendering ---------------------------------------------------------------------------
def system_prompt(tools: list[ToolSpec]) -> str:
    listing = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more of these functions to answer the user. Their "
            f"signatures:\n<tools>\n{listing}\n</tools>\n\nTo call a function, answer with "
            "one JSON object per call, each between tags:\n"
            f"{START}\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n{END}")


def call_text(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments_of(arguments)}, ensure_ascii=False)
    return f"{START}\n{body}\n{END}"


def history_text(calls: list[dict[str, Any]]) -> str:
    return "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)


# ---- parsing -----------------------------------------------------------------------------
def parse(text: str, tools: list[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, or None if there is none; the calls). A block that is not
    a JSON object naming one of the tools stays in the text."""
    return parse_whole(StreamParser(tools), text)


class StreamParser:
    """Fed the answer's text as it is generated; returns text to show and completed calls.
    Text that might be the start of a `<tool_call>` tag is held back until it is not."""

    def __init__(self, tools: list[ToolSpec]):
        self.names = {t.name for t in tools}
        self.pending = ""                 # held-back text, or the body of an open call
        self.in_call = False

    def feed(self, delta: str) -> list[Event]:
        self.pending += delta
        events: list[Event] = []
        while True:
            if self.in_call:
                end = self.pending.find(END)
                if end < 0:
                    return events
                body, self.pending = self.pending[:end], self.pending[end + len(END):]
                self.in_call = False
                call = self._call(body)
                events.append(call if call is not None else f"{START}{body}{END}")
                continue
            start = self.pending.find(START)
            if start >= 0:
                if start:
                    events.append(self.pending[:start])
                self.pending = self.pending[start + len(START):]
                self.in_call = True
                continue
            keep = partial_suffix(self.pending, START)
            if len(self.pending) > keep:
                events.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
            return events

    def finish(self) -> list[Event]:
        """At the end: an unclosed call is returned as the text it was."""
        rest = (START if self.in_call else "") + self.pending
        self.pending, self.in_call = "", False
        return [rest] if rest else []

    def _call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return call_of(obj, self.names, ("arguments", "parameters"))


# ---- forcing -----------------------------------------------------------------------------
def forcing_grammar(tools: list[ToolSpec], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect, with inline JSON schemas) whose every sentence is
    one call — or one or more, with `parallel` — of these tools, arguments valid for their
    schema."""
    schema = call_schema(tools, "arguments")
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: "{START}\\n" body "\\n{END}"\n'
            f"body: %json {json.dumps(schema)}\n")


FORMAT = ToolFormat("hermes", (START,), StreamParser, forcing_grammar, system_prompt,
                    history_text)
