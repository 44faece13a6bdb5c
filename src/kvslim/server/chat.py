"""POST /v1/chat/completions: messages rendered with the model's chat template into one engine
request with `n` completions."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse

from kvslim.engine.outputs import CompletionOutput, RequestOutput
from kvslim.errors import InvalidRequestError, KvslimError
from kvslim.lora.request import LoRARequest
from kvslim.reasoning.parser import ReasoningStream
from kvslim.server.async_engine import EngineDeadError, RequestFailedError, RequestStream
from kvslim.server.completions import usage_of
from kvslim.server.context import ServerContext
from kvslim.server.errors import engine_dead, request_failed
from kvslim.server.logprobs import chat_logprobs
from kvslim.server.protocol import ChatCompletionRequest
from kvslim.server.responses import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                     ChatCompletionResponse, ChatStreamChoice, DeltaMessage,
                                     DeltaToolCall, ToolCallOut, random_id)
from kvslim.server.streaming import DONE, sse
from kvslim.tools.chat import ToolRequest, encode_chat_with_tools
from kvslim.tools.format import StreamParser
from kvslim.tools.spec import ToolCall


@dataclass
class _Job:
    ctx: ServerContext
    request: ChatCompletionRequest
    id: str
    tools: ToolRequest
    lora: LoRARequest | None = None                      # the adapter `model` named
    created: int = field(default_factory=lambda: int(time.time()))
    finished: bool = False
    parsers: dict[int, StreamParser] = field(default_factory=dict)    # streaming, per choice
    reasoners: dict[int, ReasoningStream] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)               # calls sent, per choice

    @property
    def request_ids(self) -> list[str]:
        return [self.id]

    @property
    def model(self) -> str:
        return self.ctx.model_name_of(self.lora)

    def chunk(self, choices: list[ChatStreamChoice], usage=None) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created,
                                       model=self.model, choices=choices, usage=usage))

    def logprobs(self, completion: CompletionOutput, delta: bool = False):
        """The whole completion's logprobs, or (streaming) those of this step's new tokens."""
        if not self.request.logprobs:
            return None
        entries = completion.delta_logprobs if delta else completion.logprobs
        return chat_logprobs(self.ctx.tokenizer, entries or [])

    def abort_unfinished(self) -> None:
        if not self.finished:
            self.ctx.engine.abort(self.request_ids)


def tool_request_of(ctx: ServerContext, request: ChatCompletionRequest) -> ToolRequest:
    """The request's tools and choice, in the server's tool-call format (--tool-call-parser)."""
    return replace(request.tool_request(), format=ctx.tool_format)


def render_prompt(ctx: ServerContext, request: ChatCompletionRequest,
                  tools: ToolRequest | None = None) -> list[int]:
    messages = [m.to_template_dict() for m in request.messages]
    tools = tools or tool_request_of(ctx, request)
    try:
        return encode_chat_with_tools(ctx.tokenizer, messages, tools,
                                      request.add_generation_prompt)
    except KvslimError as e:                             # no template, or the template raised
        raise InvalidRequestError(str(e), "messages") from None


def sampling_params_of(ctx: ServerContext, request: ChatCompletionRequest, tools: ToolRequest):
    """The request's sampling; its output constraint (a format, or forced tool calls) binds
    the answer after the thinking under --reasoning-parser; special tokens stay in the text
    where the tool-call format's markers are some."""
    params = request.to_sampling_params()
    forcing = tools.forcing()
    if forcing is not None:
        if params.structured_outputs is not None:
            raise InvalidRequestError(f"tool_choice {tools.choice.mode!r} forces tool calls, "
                                      f"which leaves no room for {params.structured_outputs.param}",
                                      "tool_choice")
        params.structured_outputs = forcing
    if tools.keeps_special_tokens:
        params.skip_special_tokens = False
    if params.structured_outputs is not None and ctx.reasoning is not None:
        params.structured_outputs = replace(params.structured_outputs, reasoning=ctx.reasoning)
    return params


async def create_chat_completion(ctx: ServerContext, request: ChatCompletionRequest) -> Response:
    lora = ctx.lora_request_of(request.model)
    if request.max_tokens is not None and request.max_tokens >= ctx.max_model_len:
        # Checked even when max_completion_tokens wins: the schema promises the limit.
        raise InvalidRequestError(f"max_tokens ({request.max_tokens}) must be below "
                                  f"max_model_len ({ctx.max_model_len})", "max_tokens")
    tools = tool_request_of(ctx, request)
    params = sampling_params_of(ctx, request, tools)
    prompt = render_prompt(ctx, request, tools)
    job = _Job(ctx, request, random_id("chatcmpl"), tools, lora)
    try:
        stream = await ctx.add(job.request_ids, [prompt], params, lora)
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
    choices = []
    for c in output.outputs:
        reasoning, answer = split_reasoning(job.ctx, c.text)
        content, calls = job.tools.parse(answer) if answer is not None else (None, [])
        message = AssistantMessage(content=content, reasoning_content=reasoning,
                                   tool_calls=[ToolCallOut(**call.openai()) for call in calls])
        choices.append(ChatChoice(index=c.index, message=message, logprobs=job.logprobs(c),
                                  finish_reason=_finish_reason(c, bool(calls)),
                                  stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=job.id, created=job.created, model=job.model,
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
    reasoning, answer = _reason(job, c)
    text, calls = _split_delta(job, c, answer)
    if not (text or reasoning or calls or c.finished or logprobs is not None):
        return None
    if c.finished:
        done.add(c.index)
    first = job.calls.get(c.index, 0)
    job.calls[c.index] = first + len(calls)
    deltas = [DeltaToolCall(index=first + i, id=call.id, type="function",
                            function={"name": call.name, "arguments": call.arguments})
              for i, call in enumerate(calls)]
    finish = _finish_reason(c, job.calls[c.index] > 0) if c.finished else None
    delta = DeltaMessage(content=text or None, reasoning_content=reasoning or None,
                         tool_calls=deltas or None)
    return ChatStreamChoice(index=c.index, delta=delta,
                            logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason)


def split_reasoning(ctx: ServerContext, text: str) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, the rest) by --reasoning-parser; without one, all answer."""
    return ctx.reasoning.split(text) if ctx.reasoning is not None else (None, text)


def _reason(job: _Job, c: CompletionOutput) -> tuple[str, str]:
    """This step's new (reasoning, answer) text (all answer without a reasoning parser)."""
    if job.ctx.reasoning is None:
        return "", c.delta_text or ""
    stream = job.reasoners.setdefault(c.index, ReasoningStream(job.ctx.reasoning))
    return stream.step(c.delta_text or "", c.finished)


def _split_delta(job: _Job, c: CompletionOutput, text: str) -> tuple[str, list[ToolCall]]:
    """This step's answer text to show and the tool calls it completed (text that may open a
    call is held back until it is known)."""
    if not job.tools.parses_calls:
        return text, []
    parser = job.parsers.setdefault(c.index, job.tools.stream_parser())
    events = parser.feed(text)
    if c.finished:
        events += parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    if not job.tools.parallel:
        calls = calls[:max(0, 1 - job.calls.get(c.index, 0))]
    return "".join(e for e in events if isinstance(e, str)), calls


def _finish_reason(c: CompletionOutput, made_calls: bool) -> str | None:
    """OpenAI's "tool_calls" when an answer that ended by itself made calls."""
    return "tool_calls" if made_calls and c.finish_reason == "stop" else c.finish_reason
