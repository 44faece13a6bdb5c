"""POST /v1/responses (and GET/DELETE of a stored one): the request runs as the chat request
of the same messages; its answer becomes output items, sent whole or as the Responses event
stream (response.created, response.output_text.delta, ..., response.completed)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kvslim.errors import InvalidRequestError
from kvslim.lora.request import LoRARequest
from kvslim.server.async_engine import RequestStream
from kvslim.server.chat import (render_prompt, sampling_params_of, split_reasoning,
                                tool_request_of)
from kvslim.server.context import ServerContext
from kvslim.server.errors import OpenAIError, validation_error
from kvslim.server.responses_api.events import stream_events
from kvslim.server.responses_api.job import ResponseJob
from kvslim.server.responses_api.objects import ResponseObject, output_items
from kvslim.server.responses_api.protocol import ResponsesRequest, input_messages
from kvslim.server.responses_api.store import ResponseStore
from kvslim.server.streaming import cancel_on_disconnect

# Chat's names for the fields a Responses request calls otherwise (in error messages' param).
RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
                   "response_format": "text", "stream_options": "stream"}


def responses_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    store = ResponseStore(ctx.options.responses_store_size)

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        return await cancel_on_disconnect(request, create_response(ctx, store, body))

    # One route for both methods, so that its 405's Allow header names both.
    @router.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored(response_id: str, request: Request):
        response = _stored(store, response_id).response
        if request.method == "GET":
            return JSONResponse(response.model_dump(mode="json"))
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return router


def _stored(store: ResponseStore, response_id: str):
    stored = store.get(response_id)
    if stored is None:
        raise OpenAIError(404, f"no stored response with id {response_id!r} (kept: the last "
                               f"{store.capacity} stored)", "response_id", "not_found")
    return stored


async def create_response(ctx: ServerContext, store: ResponseStore,
                          request: ResponsesRequest) -> Response:
    lora = ctx.lora_request_of(request.model)
    job = _job(ctx, store, request, lora)
    try:
        params = sampling_params_of(ctx, job.chat, job.tools)
        prompt = render_prompt(ctx, job.chat, job.tools)
    except InvalidRequestError as e:
        e.param = RESPONSES_NAMES.get(e.param, e.param)
        raise
    try:
        stream = await ctx.add([job.id], [prompt], params, lora)
    except InvalidRequestError as e:             # e.g. a JSON format that max_tokens cannot hold
        e.param = RESPONSES_NAMES.get(e.param, e.param)
        raise
    except asyncio.CancelledError:
        ctx.engine.abort([job.id])
        raise
    if request.stream:
        return StreamingResponse(stream_events(job, stream), media_type="text/event-stream")
    return JSONResponse((await _whole(job, stream)).model_dump(mode="json"))


def _job(ctx: ServerContext, store: ResponseStore, request: ResponsesRequest,
         lora: LoRARequest | None) -> ResponseJob:
    history = []
    if request.previous_response_id is not None:
        stored = store.get(request.previous_response_id)
        if stored is None:
            raise InvalidRequestError(f"previous response {request.previous_response_id!r} is "
                                      f"not stored (kept: the last {store.capacity} stored "
                                      f"with store=true)", "previous_response_id")
        history = stored.messages
    if request.max_output_tokens is not None and request.max_output_tokens >= ctx.max_model_len:
        raise InvalidRequestError(f"max_output_tokens ({request.max_output_tokens}) must be "
                                  f"below max_model_len ({ctx.max_model_len})",
                                  "max_output_tokens")
    try:
        chat = request.chat_request(history)
    except ValidationError as e:
        error = validation_error(e.errors())
        error.param = RESPONSES_NAMES.get(error.param, error.param)
        raise error from None
    conversation = history + input_messages(request.input)
    try:
        tools = tool_request_of(ctx, chat)
    except InvalidRequestError as e:
        e.param = RESPONSES_NAMES.get(e.param, e.param)
        raise
    return ResponseJob(ctx, store, request, chat, conversation, tools, lora)


async def _whole(job: ResponseJob, stream: RequestStream) -> ResponseObject:
    final = None
    try:
        async for _, output in stream:
            final = output
        reasoning, answer = split_reasoning(job.ctx, final.outputs[0].text)
        text, calls = job.tools.parse(answer) if answer is not None else (None, [])
        status = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
        return job.finish(final, output_items(job.id, text, calls, status, reasoning))
    finally:
        job.abort_unfinished()
