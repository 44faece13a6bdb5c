"""The FastAPI app: routes, API-key check, lifespan of the engine thread. Request handling
lives in completions.py, chat.py and embeddings.py; this file only wires."""
from __future__ import annotations

import hmac
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kvslim.engine.llm_engine import LLMEngine
from kvslim.errors import InvalidRequestError
from kvslim.server.adapters import lora_router, model_cards, serve_lora_modules
from kvslim.server.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from kvslim.server.chat import create_chat_completion, render_prompt
from kvslim.server.completions import create_completion
from kvslim.server.context import ServerContext, ServerOptions
from kvslim.server.embeddings import EmbeddingRequest, EmbeddingResponse, create_embeddings
from kvslim.server.errors import (OpenAIError, engine_dead, install_error_handlers,
                                  request_failed)
from kvslim.server.metrics import HTTPMetricsMiddleware, ServerMetrics
from kvslim.server.openapi import truthful_openapi
from kvslim.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, TokenizeRequest)
from kvslim.server.responses import DetokenizeResponse, ModelList, TokenizeResponse
from kvslim.server.responses_api.route import responses_router
from kvslim.server.streaming import cancel_on_disconnect


def build_app(engine: LLMEngine, model_name: str, api_key: str | None = None,
              on_engine_crash: Callable[[], None] | None = None,
              options: ServerOptions | None = None) -> FastAPI:
    """An app serving `engine` under `model_name`. The engine thread starts with the app's
    lifespan and stops after the HTTP server has drained in-flight requests. If the engine
    thread dies of an error, every open request fails at once and `on_engine_crash` runs.
    The --lora-modules adapters are read here: a bad one is a KvslimError."""
    metrics = ServerMetrics(model_name)
    ctx = ServerContext(AsyncEngine(engine, metrics, on_engine_crash), engine.tokenizer,
                        model_name, engine.max_model_len, metrics, api_key,
                        options or ServerOptions(), hidden_size=engine.model_config.hidden_size)
    serve_lora_modules(engine, ctx.options, ctx.loras, model_name)
    return app_over(ctx, engine.model_config.vocab_size, engine.config.max_num_seqs)


def app_over(ctx: ServerContext, vocab_size: int, max_num_seqs: int) -> FastAPI:
    """The app of `ctx`, whose `engine` is an AsyncEngine or anything with its methods (the
    data-parallel replicas of kvslim.scaleout). `vocab_size` (the model's) and `max_num_seqs`
    are what /openapi.json states as limits."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.engine.start()
        yield
        await ctx.engine.stop()

    app = FastAPI(title="kvslim", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return engine_dead().response()

    @app.exception_handler(RequestFailedError)
    async def _failed(request: Request, e: RequestFailedError):
        return request_failed(str(e)).response()

    open_routes, api_routes = _open_routes(ctx), [_api_routes(ctx), responses_router(ctx)]
    if ctx.options.allow_runtime_lora_updating:
        api_routes.append(lora_router(ctx))
    app.include_router(open_routes)
    for routes in api_routes:
        app.include_router(routes, dependencies=[Depends(_key_checker(ctx.api_key))])
    endpoints = {route.path for router in (open_routes, *api_routes) for route in router.routes}
    app.add_middleware(HTTPMetricsMiddleware, metrics=ctx.metrics, endpoints=endpoints)
    vocab = {"model": vocab_size, "tokenizer": ctx.tokenizer.vocab_size}
    app.openapi = lambda: truthful_openapi(app, vocab, ctx.max_model_len, max_num_seqs,
                                           ctx.hidden_size)
    return app


def _key_checker(api_key: str | None):
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
        # Constant time, so that response timing does not reveal how much of a guess matched.
        if not hmac.compare_digest(given.strip().encode(), expected):
            raise OpenAIError(401, "incorrect API key", code="invalid_api_key")

    return check


def _open_routes(ctx: ServerContext) -> APIRouter:
    """Health and metrics: for load balancers and Prometheus, without a key."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        if not ctx.engine.is_alive:
            return engine_dead().response()
        report = ctx.engine.health()             # replicas: {"status": "ok"|"degraded", ...}
        return Response(status_code=200) if report is None else JSONResponse(report)

    @router.get("/metrics")
    async def metrics():
        await ctx.engine.collect_metrics()       # replicas: their engine series, fetched now
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)

    return router


def _api_routes(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models():
        return JSONResponse(ModelList(data=model_cards(ctx)).model_dump(mode="json"))

    @router.get("/v1/models/{model:path}")
    async def get_model(model: str):
        ctx.lora_request_of(model)                       # unknown: 404
        card = next(c for c in model_cards(ctx) if c.id == model)
        return JSONResponse(card.model_dump(mode="json"))

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await cancel_on_disconnect(request, create_completion(ctx, body))

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await cancel_on_disconnect(request, create_chat_completion(ctx, body))

    @router.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(body: EmbeddingRequest):
        return await create_embeddings(ctx, body)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.lora_request_of(body.model)                  # adapters share the tokenizer
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=[m.model_dump() for m in body.messages],
                                         tools=body.tools, tool_choice=body.tool_choice,
                                         add_generation_prompt=body.add_generation_prompt)
            tokens = render_prompt(ctx, chat)
        else:
            tokens = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse(TokenizeResponse(tokens=tokens, count=len(tokens),
                                             max_model_len=ctx.max_model_len).model_dump())

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.lora_request_of(body.model)
        vocab = ctx.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                      f"(0..{vocab - 1})", "tokens")
        return JSONResponse(DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))
                            .model_dump())

    return router
