"""Mistral's tool calls, in both of its forms:

- v0.3 (Mistral 7B Instruct v0.3, Nemo, Small 3.1): `[TOOL_CALLS] [{"name": ..., "arguments":
  {...}, "id": ...}, ...]`, every call of the turn in one JSON list;
- v11 and later (Small 3.2, Magistral, Devstral): `[TOOL_CALLS]name[ARGS]{...}` per call,
  sometimes with `[CALL_ID]id` before `[ARGS]`.

`[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]` are special tokens of Mistral's tokenizers, which
decoding drops unless told otherwise: a request that may call tools keeps them
(`markers_are_special`), and an answer that opens with a JSON list of calls is still read as v0.3
calls whose marker was dropped. Text before `[TOOL_CALLS]` is content. Mistral's templates need every call
id to be nine letters or digits, so calls parsed here get such ids: the next turn sends them
back."""
from __future__ import annotations

import json
import random
import string
from typing import Any

from kvslim.reasoning.parser import partial_suffix
from kvslim.tools.format import (Event, ToolFormat, arguments_of, call_of, call_schema,
                                 decode_json)
from kvslim.tools.spec import ToolCall, ToolSpec

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
ID_ALPHABET = string.ascii_letters + string.digits


def call_id() -> str:
    return "".join(random.choices(ID_ALPHABET, k=9))


# ---- rendering ---------------------------------------------------------------------------
def system_prompt(tools: list[ToolSpec]) -> str:
    listing = json.dumps([t.openai() for t in tools], ensure_ascii=False)
    return (f"# Tools\n\nYou may call these functions to answer the user:\n{listing}\n\nTo "
            f"call functions, answer with {TOOL_CALLS} and a JSON list of the calls: "
            f"{TOOL_CALLS} [{{\"name\": <function name>, \"arguments\": <arguments object>}}]")


def history_text(calls: list[dict[str, Any]]) -> str:
    body = ", ".join(json.dumps({"name": c["function"]["name"],
                                 "arguments": arguments_of(c["function"]["arguments"])},
                                ensure_ascii=False) for c in calls)
    return f"{TOOL_CALLS} [{body}]"


# ---- parsing -----------------------------------------------------------------------------
class StreamParser:
    """Text is given out as it comes, except what may be the start of `[TOOL_CALLS]` (or, at
    the very start of the answer, of a JSON list of calls); a call is given out when its JSON
    closes. A call that does not parse, or names no tool, is given back as the text it was."""

    def __init__(self, tools: list[ToolSpec]):
        self.names = {t.name for t in tools}
        self.pending = ""         # text not given out yet; in a call, the text after the marker
        self.state = "start"      # "start" (undecided), "text" or "call"
        self.marker = ""          # what opened the call: TOOL_CALLS, or a bare list's blanks

    def feed(self, delta: str) -> list[Event]:
        self.pending += delta
        events: list[Event] = []
        while True:
            if self.state == "start" and not self._open_bare_list():
                return events
            if self.state == "call":
                done = self._call()
                if done is None:
                    return events
                events += done
                self.state = "text"
            start = self.pending.find(TOOL_CALLS)
            if start < 0:
                keep = partial_suffix(self.pending, TOOL_CALLS)
                if len(self.pending) > keep:
                    events.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                return events
            if start:
                events.append(self.pending[:start])
            self.pending = self.pending[start + len(TOOL_CALLS):]
            self.state, self.marker = "call", TOOL_CALLS

    def finish(self) -> list[Event]:
        """At the end: an unfinished call is returned as the text it was."""
        rest = (self.marker if self.state == "call" else "") + self.pending
        self.pending, self.state = "", "text"
        return [rest] if rest else []

    def _open_bare_list(self) -> bool:
        """At the start: whether it is decided yet; a `[` then `{` opens a list of calls."""
        i = _skip_blanks(self.pending, 0)
        if i < len(self.pending) and self.pending[i] == "[":
            j = _skip_blanks(self.pending, i + 1)
            if j == len(self.pending):
                return False                                 # "[": a list, or the marker
            if self.pending[j] == "{":
                self.pending, self.state, self.marker = self.pending[i:], "call", self.pending[:i]
                return True
        elif i == len(self.pending):
            return False
        self.state = "text"
        return True

    def _call(self) -> list[Event] | None:
        """The call(s) after the marker, or its text if they are not calls; None until known.
        Consumes what it read from `pending`."""
        i = _skip_blanks(self.pending, 0)
        if i == len(self.pending):
            return None
        if self.pending[i] == "[":
            decoded = decode_json(self.pending, i)
            if decoded is None:
                return None
            calls = [call_of(c, self.names, ("arguments",), call_id)
                     for c in decoded[0]] if isinstance(decoded[0], list) else []
            end = decoded[1]
        else:
            args = self.pending.find(ARGS, i)
            j = _skip_blanks(self.pending, args + len(ARGS)) if args >= 0 else len(self.pending)
            if j == len(self.pending):
                return None
            decoded = decode_json(self.pending, j) if self.pending[j] == "{" else (None, j)
            if decoded is None:
                return None
            calls = [self._named_call(self.pending[i:args], decoded[0])]
            end = decoded[1]
        text, self.pending = self.pending[:end], self.pending[end:]
        if calls and all(calls):
            return calls
        return [self.marker + text]

    def _named_call(self, head: str, arguments: Any) -> ToolCall | None:
        """`name` or `name[CALL_ID]id` before `[ARGS]`; the model's own id is not kept."""
        name = head.partition(CALL_ID)[0].strip()
        return call_of({"name": name, "arguments": arguments}, self.names, ("arguments",),
                       call_id)


def _skip_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


# ---- forcing -----------------------------------------------------------------------------
def forcing_grammar(tools: list[ToolSpec], parallel: bool) -> str:
    """The v0.3 form, as the templates render it: `[TOOL_CALLS] [` one call — or several
    separated by ", " with `parallel` — `]`, each {"name": const, "arguments": <schema>}."""
    repeat = ' (", " call)*' if parallel else ""
    return (f'start: "{TOOL_CALLS} [" call{repeat} "]"\n'
            f"call: %json {json.dumps(call_schema(tools, 'arguments'))}\n")


FORMAT = ToolFormat("tool_calls_list", (TOOL_CALLS,), StreamParser, forcing_grammar, system_prompt,
                    history_text, markers_are_special=True)
