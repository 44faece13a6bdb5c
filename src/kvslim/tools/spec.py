"""OpenAI's `tools` and `tool_choice`, checked and reduced to what rendering, parsing and the
forcing grammar need: each function's name, description and parameter schema, and which calls
the answer must (or may) make. Every error names the field it is about."""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvslim.errors import InvalidRequestError

NAME_PATTERN = "^[a-zA-Z0-9_.-]{1,64}$"
NAME = re.compile(NAME_PATTERN)
MODES = ("none", "auto", "required")

# What the checks below accept, as JSON Schema (the server's OpenAPI schema publishes them).
TOOL_SCHEMA = {"type": "object", "required": ["function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": NAME_PATTERN},
        "description": {"type": ["string", "null"]},
        "parameters": {"type": "object"}}}}}
TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"enum": list(MODES)},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}}}}},
    {"type": "null"}]}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object",
                                                                "properties": {}})

    def openai(self) -> dict[str, Any]:
        """The tool as chat templates expect it (transformers' `tools=` argument)."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str                          # "none" | "auto" | "required" | "named"
    name: str | None = None            # the function a "named" choice forces

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass
class ToolCall:
    name: str
    arguments: str                     # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def tools_from_openai(tools: list[dict[str, Any]] | None) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools or []):
        def bad(message: str):
            raise InvalidRequestError(f"tools[{i}]: {message}", "tools")
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            bad("only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            bad("a tool needs a 'function' object")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            bad("a function needs a name of 1-64 letters, digits, '_', '.' or '-'")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            bad(f"function {name!r}: parameters must be a JSON schema object")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            bad(f"function {name!r}: description must be a string")
        if any(s.name == name for s in specs):
            bad(f"function {name!r} is defined twice")
        specs.append(ToolSpec(name, description or "", parameters))
    return specs


def tool_choice_of(choice: str | dict | None, tools: list[ToolSpec]) -> ToolChoice:
    """OpenAI's defaults: "auto" when tools are given, "none" otherwise."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in MODES:
            raise InvalidRequestError(f"tool_choice must be one of {', '.join(MODES)} or "
                                      f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; "
                                      f"got {choice!r}", "tool_choice")
        if choice == "required" and not tools:
            raise InvalidRequestError("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(choice)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError("a named tool_choice is {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}", "tool_choice")
    if name not in {t.name for t in tools}:
        known = ", ".join(t.name for t in tools) or "none"
        raise InvalidRequestError(f"tool_choice names function {name!r}, which is not among "
                                  f"the tools ({known})", "tool_choice")
    return ToolChoice("named", name)
