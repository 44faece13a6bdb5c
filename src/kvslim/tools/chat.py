"""A chat request with tools: its prompt (the template lays the tools out, or kvslim does in the
request's tool-call format), the constraint that forces calls, and the parsing of the answer.

Which prompt a model gets: a template that renders `tools` and speaks the format (Qwen2,
Qwen2.5, Qwen3 and Hermes' `<tool_call>`, Llama 3.1's JSON, Mistral's `[TOOL_CALLS]`) renders
them itself; every other template (SmolLM2, Gemma 3) gets kvslim's system message describing
the tools in the format, so that the format's parser and forcing grammar serve every model
(registry.py chooses the format; docs/structured_outputs.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvslim.structured.params import StructuredOutputsParams
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.tools import hermes
from kvslim.tools.format import StreamParser, ToolFormat, arguments_of
from kvslim.tools.spec import (ToolCall, ToolChoice, ToolSpec, tool_choice_of,
                               tools_from_openai)


@dataclass(frozen=True)
class ToolRequest:
    tools: list[ToolSpec]
    choice: ToolChoice
    parallel: bool = True
    format: ToolFormat = hermes.FORMAT             # how calls are written, read and forced

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice: str | dict | None,
           parallel_tool_calls: bool | None = None,
           format: ToolFormat = hermes.FORMAT) -> "ToolRequest":
        specs = tools_from_openai(tools)
        return cls(specs, tool_choice_of(tool_choice, specs),
                   True if parallel_tool_calls is None else parallel_tool_calls, format)

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    def forcing(self) -> StructuredOutputsParams | None:
        """tool_choice "required" or a named function: a grammar that admits only calls."""
        if not self.choice.forced:
            return None
        tools = [t for t in self.tools if self.choice.mode == "required"
                 or t.name == self.choice.name]
        return StructuredOutputsParams(grammar=self.format.forcing_grammar(tools, self.parallel),
                                       param="tool_choice")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if not self.parses_calls:
            return text, []
        content, calls = self.format.parse(text, self.tools)
        if not self.parallel:
            calls = calls[:1]
        return content, calls

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the answer's text must keep special tokens: the format's markers are some."""
        return self.parses_calls and self.format.markers_are_special

    def stream_parser(self) -> StreamParser | None:
        return self.format.stream_parser(self.tools) if self.parses_calls else None


def native_tools(tokenizer: Tokenizer, format: ToolFormat = hermes.FORMAT) -> bool:
    """Whether the chat template lays out tools, and in this format."""
    return tokenizer.template_renders_tools and format.spoken_by(tokenizer.chat_template)


def encode_chat_with_tools(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                           tools: ToolRequest, add_generation_prompt: bool = True) -> list[int]:
    if native_tools(tokenizer, tools.format):
        kwargs = {"tools": [t.openai() for t in tools.tools]} if tools.tools else {}
        return tokenizer.encode_chat(_with_argument_objects(messages), add_generation_prompt,
                                     **kwargs)
    return tokenizer.encode_chat(fallback_messages(messages, tools.tools, tools.format),
                                 add_generation_prompt)


def fallback_messages(messages: list[dict[str, Any]], tools: list[ToolSpec],
                      format: ToolFormat = hermes.FORMAT) -> list[dict[str, Any]]:
    """For a template that knows no tools: the tools in the system message, earlier calls as
    the assistant's text, tool results as user turns (Qwen's <tool_response> convention)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = "\n".join(([m["content"]] if m.get("content") else [])
                             + [format.history_text(m["tool_calls"])])
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        prompt = format.system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _with_argument_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Templates expect an earlier call's arguments as a mapping (transformers' convention);
    OpenAI sends them as JSON text."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"],
                                        "arguments": arguments_of(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
