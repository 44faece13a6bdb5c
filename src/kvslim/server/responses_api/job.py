"""`ResponseJob`: one /v1/responses request on its way through the engine, and the response
object it makes (echoing the request's settings), stored when the request asks."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvslim.engine.outputs import RequestOutput
from kvslim.lora.request import LoRARequest
from kvslim.server.context import ServerContext
from kvslim.server.protocol import ChatCompletionRequest
from kvslim.server.responses_api.objects import (IncompleteDetails, ResponseObject,
                                                 ResponseUsage, new_id)
from kvslim.server.responses_api.protocol import ResponsesRequest
from kvslim.server.responses_api.store import ResponseStore
from kvslim.tools.chat import ToolRequest


@dataclass
class ResponseJob:
    """One /v1/responses request on its way through the engine."""
    ctx: ServerContext
    store: ResponseStore
    request: ResponsesRequest
    chat: ChatCompletionRequest
    conversation: list[dict]                     # the messages it answers, without instructions
    tools: ToolRequest
    lora: LoRARequest | None = None              # the adapter `model` named
    id: str = field(default_factory=lambda: new_id("resp"))
    finished: bool = False

    def snapshot(self, **fields) -> ResponseObject:
        """The response object, echoing the request's settings."""
        r = self.request
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        return ResponseObject(
            id=self.id, model=self.ctx.model_name_of(self.lora), instructions=r.instructions,
            max_output_tokens=r.max_output_tokens, temperature=r.temperature, top_p=r.top_p,
            previous_response_id=r.previous_response_id,
            parallel_tool_calls=self.tools.parallel,
            tool_choice=r.tool_choice.model_dump() if hasattr(r.tool_choice, "model_dump")
            else r.tool_choice or "auto",
            tools=[t.model_dump(exclude_none=True) for t in r.tools or []],
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                  else {"type": "text"}},
            store=r.store, metadata=r.metadata or {}, **fields)

    def finish(self, output: RequestOutput, items) -> ResponseObject:
        """The final response (stored when asked): completed, or incomplete when the budget
        ended the answer."""
        cut = output.outputs[0].finish_reason == "length"
        response = self.snapshot(
            status="incomplete" if cut else "completed", output=items,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
            usage=ResponseUsage.of(output))
        if self.request.store:
            self.store.put(response, self.conversation)
        self.finished = True
        return response

    def abort_unfinished(self) -> None:
        if not self.finished:
            self.ctx.engine.abort([self.id])
