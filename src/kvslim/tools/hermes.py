"""The Hermes tool-call format: each call a JSON object {"name": ..., "arguments": {...}} between
`<tool_call>` and `</tool_call>` lines. Qwen2, Qwen2.5, Qwen3 and the Hermes models are trained on
it and their chat templates render the tools themselves; for a template that does not render
tools (SmolLM2's, Gemma 3's), kvslim describes them in this format in a system message
(`fallback_messages`). Also here: the parser of whole answers and of streamed ones, and the
grammar that forces calls for tool_choice "required" or a named function."""
from __future__ import annotations

import json
from typing import Any

from kvslim.structured.grammar import JSON_OPTIONS
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
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{START}\n{body}\n{END}"


def fallback_messages(messages: list[dict[str, Any]], tools: list[ToolSpec]
                      ) -> list[dict[str, Any]]:
    """For a template that knows no tools: the tools in the system message, earlier calls as
    the assistant's text, tool results as user turns (Qwen's <tool_response> convention)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"])
                     for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        prompt = system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---- parsing -----------------------------------------------------------------------------
def parse(text: str, tools: list[ToolSpec]) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, or None if there is none; the calls). A block that is not
    a JSON object naming one of the tools stays in the text."""
    parser = StreamParser(tools)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str)).strip()
    return content or None, [e for e in events if isinstance(e, ToolCall)]


class StreamParser:
    """Fed the answer's text as it is generated; returns text to show and completed calls.
    Text that might be the start of a `<tool_call>` tag is held back until it is not."""

    def __init__(self, tools: list[ToolSpec]):
        self.names = {t.name for t in tools}
        self.pending = ""                 # held-back text, or the body of an open call
        self.in_call = False

    def feed(self, delta: str) -> list[str | ToolCall]:
        self.pending += delta
        events: list[str | ToolCall] = []
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
            keep = _partial_tag(self.pending)
            if len(self.pending) > keep:
                events.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
            return events

    def finish(self) -> list[str | ToolCall]:
        """At the end: an unclosed call is returned as the text it was."""
        rest = (START if self.in_call else "") + self.pending
        self.pending, self.in_call = "", False
        return [rest] if rest else []

    def _call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):
            return ToolCall(obj["name"], arguments)
        return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_tag(text: str) -> int:
    """How many trailing characters of `text` could begin a `<tool_call>` tag."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


# ---- forcing -----------------------------------------------------------------------------
def forcing_grammar(tools: list[ToolSpec], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect, with inline JSON schemas) whose every sentence is
    one call — or one or more, with `parallel` — of these tools, arguments valid for their
    schema."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name},
                                               "arguments": closed(t.parameters)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools]
    schema = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = JSON_OPTIONS
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: "{START}\\n" body "\\n{END}"\n'
            f"body: %json {json.dumps(schema)}\n")


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
