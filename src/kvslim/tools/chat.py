"""A chat request with tools: its prompt (the template lays the tools out, or kvslim does in the
Hermes format), the constraint that forces calls, and the parsing of the answer.

Which format a model gets: a template that renders `tools` and speaks `<tool_call>` (Qwen2,
Qwen2.5, Qwen3, Hermes) renders them itself; every other template (SmolLM2, Gemma 3, and for now
Llama 3.1's and Mistral's own tool formats) gets kvslim's Hermes system message, so that one
parser and one forcing grammar serve every model (docs/structured_outputs.md)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvslim.structured.params import StructuredOutputsParams
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.tools import hermes
from kvslim.tools.spec import (ToolCall, ToolChoice, ToolSpec, tool_choice_of,
                               tools_from_openai)


@dataclass(frozen=True)
class ToolRequest:
    tools: list[ToolSpec]
    choice: ToolChoice
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice: str | dict | None,
           parallel_tool_calls: bool | None = None) -> "ToolRequest":
        specs = tools_from_openai(tools)
        return cls(specs, tool_choice_of(tool_choice, specs),
                   True if parallel_tool_calls is None else parallel_tool_calls)

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    def forcing(self) -> StructuredOutputsParams | None:
        """tool_choice "required" or a named function: a grammar that admits only calls."""
        if not self.choice.forced:
            return None
        tools = [t for t in self.tools if self.choice.mode == "required"
                 or t.name == self.choice.name]
        return StructuredOutputsParams(grammar=hermes.forcing_grammar(tools, self.parallel),
                                       param="tool_choice")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if not self.parses_calls:
            return text, []
        content, calls = hermes.parse(text, self.tools)
        if not self.parallel:
            calls = calls[:1]
        return content, calls

    def stream_parser(self) -> hermes.StreamParser | None:
        return hermes.StreamParser(self.tools) if self.parses_calls else None


def native_tools(tokenizer: Tokenizer) -> bool:
    return tokenizer.template_renders_tools and hermes.START in tokenizer.chat_template


def encode_chat_with_tools(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                           tools: ToolRequest, add_generation_prompt: bool = True) -> list[int]:
    if native_tools(tokenizer):
        kwargs = {"tools": [t.openai() for t in tools.tools]} if tools.tools else {}
        return tokenizer.encode_chat(_with_argument_objects(messages), add_generation_prompt,
                                     **kwargs)
    return tokenizer.encode_chat(hermes.fallback_messages(messages, tools.tools),
                                 add_generation_prompt)


def _with_argument_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Templates expect an earlier call's arguments as a mapping (transformers' convention);
    OpenAI sends them as JSON text."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                arguments = c["function"]["arguments"]
                try:
                    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
                except ValueError:
                    pass
                calls.append({**c, "function": {**c["function"], "arguments": arguments}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
