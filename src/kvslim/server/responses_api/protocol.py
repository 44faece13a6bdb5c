"""The Responses API's request body, and how it becomes a chat request: `input` items to chat
messages, `instructions` to the system message, `text.format` to response_format, the flat
function tools to chat's nested ones."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Field

from kvslim.server.protocol import ChatCompletionRequest, NonEmpty, _int, _Request


class InputText(_Request):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputText]]

    def chat(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str                                     # JSON text
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: str
    id: Optional[str] = None
    status: Optional[str] = None


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    def chat(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.parameters or {"type": "object"}}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class NamedFunction(_Request):
    type: Literal["function"]
    name: NonEmpty


class TextFormat(_Request):
    """text.format: plain text, any JSON object, or a JSON schema (its fields flat, unlike
    chat's response_format)."""
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name or "response", "schema": self.schema_,
                  "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": schema}


class TextOptions(_Request):
    format: Optional[TextFormat] = None


class ResponsesRequest(_Request):
    model_config = ConfigDict(json_schema_extra={"if": {
        "required": ["tool_choice"], "properties": {"tool_choice": {
            "anyOf": [{"const": "required"}, {"type": "object"}]}}},
        "then": {"required": ["tools"], "properties": {"tools": {"minItems": 1}}}})
    model: Optional[str] = None
    input: Union[NonEmpty, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[_int(ge=1)] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: bool = False
    text: Optional[TextOptions] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: Optional[bool] = None
    previous_response_id: Optional[NonEmpty] = None
    store: bool = True
    metadata: Optional[dict[str, str]] = None

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as chat messages: `history` (a previous response's), then this
        input; instructions first as the system message (never carried over, as OpenAI's)."""
        own = input_messages(self.input)
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return system + history + own

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        fmt = self.text.format if self.text is not None else None
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": self.messages(history),
            "max_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "stream": self.stream,
            "tools": [t.chat() for t in self.tools] if self.tools else None,
            "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": fmt.response_format() if fmt is not None else None,
            "stream_options": {"include_usage": True} if self.stream else None})


def input_messages(given: Union[str, list[InputItem]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a string is one user turn; function calls in a row are one
    assistant turn with tool_calls; a call's output is a tool turn."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for item in given:
        if isinstance(item, MessageItem):
            messages.append(item.chat())
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
    return messages
