"""POST /v1/chat/completions: messages rendered with the model's chat template into one engine
request with `n` completions."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse

from kvslim.engine.outputs import CompletionOutput, RequestOutput
from kvslim.errors import InvalidRequestError, KvslimError
from kvslim.server.async_engine import EngineDeadError, RequestFailedError, RequestStream
from kvslim.server.completions import usage_of
from kvslim.server.context import ServerContext
from kvslim.server.errors import engine_dead, request_failed
from kvslim.server.logprobs import chat_logprobs
from kvslim.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                    ChatCompletionRequest, ChatCompletionResponse,
                                    ChatStreamChoice, DeltaMessage, random_id)
from kvslim.server.streaming import DONE, sse


@dataclass
class _Job:
    ctx: ServerContext
    request: ChatCompletionRequest
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    finished: bool = False

    @property
    def request_ids(self) -> list[str]:
        return [self.id]

    def chunk(self, choices: list[ChatStreamChoice], usage=None) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created,
                                       model=self.ctx.model_name, choices=choices, usage=usage))

    def logprobs(self, completion: CompletionOutput, delta: bool = False):
        """The whole completion's logprobs, or (streaming) those of this step's new tokens."""
        if not self.request.logprobs:
            return None
        entries = completion.delta_logprobs if delta else completion.logprobs
        return chat_logprobs(self.ctx.tokenizer, entries or [])

    def abort_unfinished(self) -> None:
        if not self.finished:
            self.ctx.engine.abort(self.request_ids)


def render_prompt(ctx: ServerContext, request: ChatCompletionRequest) -> list[int]:
    messages = [m.to_template_dict() for m in request.messages]
    try:
        return ctx.tokenizer.encode_chat(messages, request.add_generation_prompt)
    except KvslimError as e:                             # no template, or the template raised
        raise InvalidRequestError(str(e), "messages") from None


async def create_chat_completion(ctx: ServerContext, request: ChatCompletionRequest) -> Response:
    ctx.check_model(request.model)
    params = request.to_sampling_params()
    prompt = render_prompt(ctx, request)
    job = _Job(ctx, request, random_id("chatcmpl"))
    try:
        stream = await ctx.engine.add(job.request_ids, [prompt], params)
    except asyncio.CancelledError:
        ctx.engine.abort(job.request_ids)
        raise
    if request.stream:
        return StreamingResponse(_stream(job, stream), media_type="text/event-stream")
    final = None
    try:
        async for _, output in stream:
            final = output
        job.finished = True
    finally:
        job.abort_unfinished()
    return JSONResponse(_response(job, final).model_dump(mode="json"))


def _response(job: _Job, output: RequestOutput) -> ChatCompletionResponse:
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=job.logprobs(c), finish_reason=c.finish_reason,
                          stop_reason=c.stop_reason)
               for c in output.outputs]
    return ChatCompletionResponse(id=job.id, created=job.created, model=job.ctx.model_name,
                                  choices=choices, usage=usage_of([output]))


async def _stream(job: _Job, stream: RequestStream) -> AsyncIterator[str]:
    """The role first for every choice, then content deltas; the chunk that carries a choice's
    last text also carries its finish_reason."""
    done: set[int] = set()
    final = None
    try:
        yield job.chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                      content=""))
                         for i in range(job.request.n)])
        async for _, output in stream:
            choices = [choice for c in output.outputs
                       if (choice := _chunk_choice(job, c, done)) is not None]
            if choices:
                yield job.chunk(choices)
            final = output
        job.finished = True
        if job.request.include_usage:
            yield job.chunk([], usage=usage_of([final]))
        yield DONE
    except EngineDeadError:
        yield sse(engine_dead().body())
        yield DONE
    except RequestFailedError as e:
        yield sse(request_failed(str(e)).body())
        yield DONE
    finally:
        job.abort_unfinished()


def _chunk_choice(job: _Job, c: CompletionOutput, done: set[int]) -> ChatStreamChoice | None:
    if c.index in done:
        return None
    new_tokens = len(c.delta_token_ids)
    logprobs = job.logprobs(c, delta=True) if new_tokens else None
    if not c.delta_text and not c.finished and logprobs is None:
        return None
    if c.finished:
        done.add(c.index)
    return ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.delta_text or None),
                            logprobs=logprobs, finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason)
