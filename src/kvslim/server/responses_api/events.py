"""The Responses event stream: every event an SSE message with its `type` as the event name and
a `sequence_number`; the text as output_text deltas of one message item, each tool call as a
function_call item whose arguments come whole in one delta, then response.completed (or
response.incomplete) with the final response, which lists the items as they were streamed."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from itertools import count
from typing import Any

from kvslim.reasoning.parser import ReasoningStream
from kvslim.server.async_engine import EngineDeadError, RequestFailedError, RequestStream
from kvslim.server.errors import OpenAIError, engine_dead, request_failed
from kvslim.server.responses_api.job import ResponseJob
from kvslim.server.responses_api.objects import (FunctionCallOutput, MessageOutput, OutputText,
                                                 ReasoningOutput, ReasoningText, call_item_id,
                                                 message_id, reasoning_id)
from kvslim.tools.spec import ToolCall


class _Events:
    """Numbers the events and keeps the items streamed so far."""

    def __init__(self, job: ResponseJob):
        self.job = job
        self.numbers = count()
        self.items: list[ReasoningOutput | MessageOutput | FunctionCallOutput] = []
        self.reasoning: ReasoningOutput | None = None
        self.message: MessageOutput | None = None
        self.calls = 0

    def event(self, type: str, **data: Any) -> str:
        body = {"type": type, "sequence_number": next(self.numbers)}
        body.update({k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v
                     for k, v in data.items()})
        return f"event: {type}\ndata: {json.dumps(body)}\n\n"

    def think(self, delta: str) -> list[str]:
        out = []
        if self.reasoning is None:
            self.reasoning = ReasoningOutput(id=reasoning_id(self.job.id), status="in_progress",
                                             content=[ReasoningText(text="")])
            self.items.append(self.reasoning)
            out.append(self.event("response.output_item.added", output_index=0,
                                  item=self.reasoning))
        self.reasoning.content[0].text += delta
        out.append(self.event("response.reasoning_text.delta", item_id=self.reasoning.id,
                              output_index=0, content_index=0, delta=delta))
        return out

    def close_reasoning(self, status: str = "completed") -> list[str]:
        """Once the answer begins (or the response ends)."""
        if self.reasoning is None or self.reasoning.status != "in_progress":
            return []
        self.reasoning.status = status
        ref = {"item_id": self.reasoning.id, "output_index": 0, "content_index": 0}
        return [self.event("response.reasoning_text.done", **ref,
                           text=self.reasoning.content[0].text),
                self.event("response.output_item.done", output_index=0, item=self.reasoning)]

    def text(self, delta: str) -> list[str]:
        out = self.close_reasoning()
        if self.message is None:
            self.message = MessageOutput(id=message_id(self.job.id), status="in_progress")
            self.items.append(self.message)
            out.append(self.event("response.output_item.added", output_index=self._index(),
                                  item=self.message))
            self.message.content.append(OutputText(text=""))
            out.append(self.event("response.content_part.added", **self._part(),
                                  part=OutputText(text="")))
        self.message.content[0].text += delta
        out.append(self.event("response.output_text.delta", **self._part(), delta=delta,
                              logprobs=[]))
        return out

    def call(self, call: ToolCall) -> list[str]:
        item = FunctionCallOutput(id=call_item_id(self.job.id, self.calls), call_id=call.id,
                                  name=call.name, arguments="", status="in_progress")
        self.calls += 1
        out = self.close_reasoning()
        self.items.append(item)
        index = len(self.items) - 1
        ref = {"item_id": item.id, "output_index": index}
        out += [self.event("response.output_item.added", output_index=index, item=item),
               self.event("response.function_call_arguments.delta", **ref,
                          delta=call.arguments),
               self.event("response.function_call_arguments.done", **ref,
                          arguments=call.arguments)]
        item.arguments, item.status = call.arguments, "completed"
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def close_message(self, status: str) -> list[str]:
        out = self.close_reasoning(status)
        if self.message is None:
            if self.calls:
                return out
            out += self.text("")                  # an empty answer is still one message
        part, text = self._part(), self.message.content[0]
        self.message.status = status
        return out + [self.event("response.output_text.done", **part, text=text.text, logprobs=[]),
                self.event("response.content_part.done", **part, part=text),
                self.event("response.output_item.done", output_index=self._index(),
                           item=self.message)]

    def _index(self) -> int:
        return self.items.index(self.message)

    def _part(self) -> dict[str, Any]:
        return {"item_id": self.message.id, "output_index": self._index(), "content_index": 0}


async def stream_events(job: ResponseJob, stream: RequestStream) -> AsyncIterator[str]:
    events = _Events(job)
    parser = job.tools.stream_parser()
    reasoner = ReasoningStream(job.ctx.reasoning) if job.ctx.reasoning is not None else None
    yield events.event("response.created", response=job.snapshot())
    yield events.event("response.in_progress", response=job.snapshot())
    try:
        final = None
        async for _, output in stream:
            c = output.outputs[0]
            thought, answer = (reasoner.step(c.delta_text or "", c.finished) if reasoner
                               else ("", c.delta_text or ""))
            if thought:
                for e in events.think(thought):
                    yield e
            pieces = parser.feed(answer) if parser else [answer]
            if parser is not None and c.finished:
                pieces += parser.finish()
            for piece in pieces:
                if isinstance(piece, ToolCall):
                    if job.tools.parallel or events.calls == 0:
                        for e in events.call(piece):
                            yield e
                elif piece:
                    for e in events.text(piece):
                        yield e
            final = output
        status = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
        for e in events.close_message(status):
            yield e
        response = job.finish(final, events.items)
        yield events.event(f"response.{status}", response=response)
    except (EngineDeadError, RequestFailedError) as e:
        error: OpenAIError = (engine_dead() if isinstance(e, EngineDeadError)
                              else request_failed(str(e)))
        yield events.event("error", code=error.code, message=error.message, param=None)
    finally:
        job.abort_unfinished()

