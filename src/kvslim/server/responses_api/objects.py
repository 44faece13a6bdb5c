"""What /v1/responses sends back: the response object, its output items, its usage, and the
events of its stream (each with its `type` and a `sequence_number`)."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from kvslim.engine.outputs import RequestOutput
from kvslim.tools.spec import ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageOutput(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    """The thinking before the answer (--reasoning-parser)."""
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


OutputItem = Union[ReasoningOutput, MessageOutput, FunctionCallOutput]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, output: RequestOutput) -> "ResponseUsage":
        prompt = len(output.prompt_token_ids)
        completion = sum(len(c.token_ids or []) for c in output.outputs)
        cached = InputTokensDetails(cached_tokens=output.metrics.num_cached_tokens)
        return cls(input_tokens=prompt, input_tokens_details=cached, output_tokens=completion,
                   total_tokens=prompt + completion)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    incomplete_details: Optional[IncompleteDetails] = None
    error: Optional[dict[str, Any]] = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: Optional[ResponseUsage] = None
    # The request's settings, echoed as OpenAI does
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    previous_response_id: Optional[str] = None
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)


def output_items(response_id: str, text: str | None, calls: list[ToolCall],
                 status: str = "completed", reasoning: str | None = None) -> list[OutputItem]:
    """The answer's items: its reasoning, if any, its text as one message (none when the answer
    is only calls), then one function_call item per call. Ids derive from the response's, so
    that the items a stream announced are the ones the final response lists."""
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningOutput(id=reasoning_id(response_id), status=status,
                                     content=[ReasoningText(text=reasoning)]))
    if text or not calls:
        items.append(MessageOutput(id=message_id(response_id), status=status,
                                   content=[OutputText(text=text or "")]))
    items += [FunctionCallOutput(id=call_item_id(response_id, i), call_id=call.id,
                                 name=call.name, arguments=call.arguments)
              for i, call in enumerate(calls)]
    return items


def reasoning_id(response_id: str) -> str:
    return "rs_" + response_id.removeprefix("resp_")


def message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def call_item_id(response_id: str, index: int) -> str:
    return f"fc_{response_id.removeprefix('resp_')}_{index}"
