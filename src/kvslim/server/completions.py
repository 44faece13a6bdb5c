"""POST /v1/completions: one engine request per prompt (each with `n` completions); choice
index = prompt_index * n + completion index, as OpenAI numbers them."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse

from kvslim.engine.outputs import CompletionOutput, RequestOutput
from kvslim.lora.request import LoRARequest
from kvslim.server.async_engine import EngineDeadError, RequestFailedError, RequestStream
from kvslim.server.context import ServerContext
from kvslim.server.errors import engine_dead, request_failed
from kvslim.server.logprobs import completion_logprobs, echo_logprobs, join_logprobs
from kvslim.server.protocol import CompletionRequest
from kvslim.server.responses import (CompletionChoice, CompletionResponse, PromptTokensDetails,
                                     Usage, random_id)
from kvslim.server.streaming import DONE, sse


@dataclass
class _Job:
    ctx: ServerContext
    request: CompletionRequest
    id: str
    request_ids: list[str]
    lora: LoRARequest | None = None                      # the adapter `model` named
    created: int = field(default_factory=lambda: int(time.time()))
    finished: set[int] = field(default_factory=set)      # prompt indexes whose request ended

    @property
    def model(self) -> str:
        return self.ctx.model_name_of(self.lora)

    def choice_index(self, prompt_index: int, completion: CompletionOutput) -> int:
        return prompt_index * self.request.n + completion.index

    def echo_text(self, output: RequestOutput) -> str:
        if not self.request.echo:
            return ""
        if output.prompt is not None:
            return output.prompt
        return self.ctx.tokenizer.decode(output.prompt_token_ids)

    def logprobs(self, output: RequestOutput, entries, text_offset: int, first: bool):
        """The legacy logprobs of `entries` (generated tokens); the first chunk of an echoed
        choice starts with the prompt's."""
        if self.request.logprobs is None:
            return None
        generated = completion_logprobs(self.ctx.tokenizer, entries or [], text_offset)
        if not (first and self.request.echo):
            return generated
        prompt = echo_logprobs(self.ctx.tokenizer, output.prompt_token_ids,
                               output.prompt_logprobs)
        return join_logprobs(prompt, generated)

    def abort_unfinished(self) -> None:
        if len(self.finished) < len(self.request_ids):
            self.ctx.engine.abort(self.request_ids)


async def create_completion(ctx: ServerContext, request: CompletionRequest) -> Response:
    lora = ctx.lora_request_of(request.model)
    prompts = request.prompts()
    params = request.to_sampling_params()
    completion_id = random_id("cmpl")
    job = _Job(ctx, request, completion_id,
               [f"{completion_id}-{i}" for i in range(len(prompts))], lora)
    try:
        stream = await ctx.add(job.request_ids, prompts, params, lora)   # 400s come from here
    except asyncio.CancelledError:
        ctx.engine.abort(job.request_ids)
        raise
    if request.stream:
        return StreamingResponse(_stream(job, stream), media_type="text/event-stream")
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in stream:
            if output.finished:
                finals[index] = output
                job.finished.add(index)
    finally:
        job.abort_unfinished()
    return JSONResponse(_response(job, [finals[i] for i in range(len(prompts))])
                        .model_dump(mode="json"))


def _response(job: _Job, outputs: list[RequestOutput]) -> CompletionResponse:
    choices = []
    for index, output in enumerate(outputs):
        prefix = job.echo_text(output)
        for c in output.outputs:
            logprobs = job.logprobs(output, c.logprobs, len(prefix), first=True)
            choices.append(CompletionChoice(
                index=job.choice_index(index, c), text=prefix + c.text, logprobs=logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=job.id, created=job.created, model=job.model,
                              choices=choices, usage=usage_of(outputs))


def usage_of(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def _stream(job: _Job, stream: RequestStream) -> AsyncIterator[str]:
    """SSE chunks; runs until every request finished, or until Starlette cancels it because
    the client went away (then `finally` aborts what is left)."""
    done_choices: set[int] = set()
    text_sent: dict[int, int] = {}                       # choice -> characters sent (offsets)
    finals: list[RequestOutput] = []
    try:
        async for index, output in stream:
            for c in output.outputs:
                choice = _chunk_choice(job, index, output, c, done_choices, text_sent)
                if choice is not None:
                    yield sse(CompletionResponse(id=job.id, created=job.created,
                                                 model=job.model, choices=[choice]))
            if output.finished:
                job.finished.add(index)
                finals.append(output)
        if job.request.include_usage:
            yield sse(CompletionResponse(id=job.id, created=job.created, model=job.model,
                                         choices=[], usage=usage_of(finals)))
        yield DONE
    except EngineDeadError:
        yield sse(engine_dead().body())
        yield DONE
    except RequestFailedError as e:
        yield sse(request_failed(str(e)).body())
        yield DONE
    finally:
        job.abort_unfinished()


def _chunk_choice(job: _Job, index: int, output: RequestOutput, c: CompletionOutput,
                  done_choices: set[int], text_sent: dict[int, int]) -> CompletionChoice | None:
    """The chunk for one completion's progress this step, or None if there is nothing new."""
    number = job.choice_index(index, c)
    if number in done_choices:                           # n > 1: siblings still report it
        return None
    text = c.delta_text
    first = number not in text_sent
    if first:
        text = job.echo_text(output) + text
    logprobs = None
    if c.delta_token_ids or (first and job.request.echo):
        logprobs = job.logprobs(output, c.delta_logprobs, text_sent.get(number, 0) +
                                (len(text) - len(c.delta_text)), first)
    if not text and not c.finished and logprobs is None:
        return None
    text_sent[number] = text_sent.get(number, 0) + len(text)
    if c.finished:
        done_choices.add(number)
    return CompletionChoice(index=number, text=text, logprobs=logprobs,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
