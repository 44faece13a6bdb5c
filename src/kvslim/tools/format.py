"""What every tool-call format provides, and the pieces they share.

A format (hermes.py, plain_json.py, tool_calls_list.py) is the text a model family writes to call a
function. It knows how to tell its calls apart from the answer's text (whole, or streamed one
delta at a time), how to force calls with a grammar (tool_choice "required" or a named
function), how to describe the tools to a model whose chat template does not, and which strings
in a chat template show that the template speaks it (registry.py chooses by them)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvslim.structured.grammar import JSON_OPTIONS
from kvslim.tools.spec import ToolCall, ToolSpec

Event = str | ToolCall               # text to show, or a completed call


class StreamParser(Protocol):
    """Fed the answer's text as it is generated: returns text to show and completed calls, in
    order. Whatever way the text is cut into deltas, the events add up to the same text and
    the same calls."""

    def feed(self, delta: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


@dataclass(frozen=True)
class ToolFormat:
    name: str
    # Strings whose presence in a chat template shows it lays calls out in this format.
    template_markers: tuple[str, ...]
    stream_parser: Callable[[list[ToolSpec]], StreamParser]
    # (tools, parallel) -> a Lark grammar whose every sentence is one call, or several
    forcing_grammar: Callable[[list[ToolSpec], bool], str]
    # For a template that knows no tools: the system text describing them, and an earlier
    # turn's calls (OpenAI's tool_calls) as the assistant's text.
    system_prompt: Callable[[list[ToolSpec]], str]
    history_text: Callable[[list[dict[str, Any]]], str]
    # The markers are special tokens of the family's tokenizers: an answer that may call tools
    # keeps special tokens in its text, or the parser would never see them (as vLLM does).
    markers_are_special: bool = False

    def parse(self, text: str, tools: list[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
        return parse_whole(self.stream_parser(tools), text)

    def spoken_by(self, chat_template: str | None) -> bool:
        return bool(chat_template) and any(m in chat_template for m in self.template_markers)


def parse_whole(parser: StreamParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, or None if there is none; the calls). Whole answers go
    through the streaming parser, so the two can never disagree. Beside calls the text is
    stripped (models leave blank lines around them); without calls it is the answer as is,
    exactly what streaming shows."""
    events = parser.feed(text) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    return (content.strip() if calls else content) or None, calls


def call_of(obj: Any, names: set[str], arguments_keys: tuple[str, ...] = ("arguments",),
            new_id: Callable[[], str] | None = None) -> ToolCall | None:
    """A decoded JSON value as a call: an object naming one of the tools, its arguments an
    object (or JSON text of one) under the first of `arguments_keys` it has. None otherwise:
    the caller keeps the text as text."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(obj["name"], text) if new_id is None else ToolCall(obj["name"], text, new_id())


def decode_json(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value starting at text[start] and the index after it; None while it is not
    complete (or never will be: the caller waits for the end of the answer to know). Only
    for objects and arrays, whose closing bracket makes a prefix's answer final."""
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None


def arguments_of(arguments: Any) -> Any:
    """An earlier call's arguments as a mapping where they are JSON text of one (OpenAI sends
    text, templates and the formats' own text want the object)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            pass
    return arguments


# ---- forcing -----------------------------------------------------------------------------
def call_schema(tools: list[ToolSpec], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call object {"name": const, <arguments_key>: <its schema>} of
    any of `tools`, with llguidance's whitespace options."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                               arguments_key: closed(t.parameters)},
              "required": ["name", arguments_key], "additionalProperties": False}
             for t in tools]
    schema = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = JSON_OPTIONS
    return schema


def closed(schema):
    """`schema` with additionalProperties false wherever an object schema leaves it unsaid:
    every call it admits still validates against the tool's schema, and a small model cannot
    invent argument after argument until max_tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
