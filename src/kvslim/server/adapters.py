"""LoRA adapters served as models, with vLLM's interface: `kvslim serve --enable-lora
--lora-modules NAME=PATH ...` serves each peft adapter beside the base model under its own
name; /v1/models lists them (their `parent` is the base model); a request's `model` picks one.
With --allow-runtime-lora-updating, POST /v1/load_lora_adapter and /v1/unload_lora_adapter
change the set while the server runs (without it those routes do not exist).

Adapters are read and checked on the engine thread (at start, before it runs), so a bad
directory is refused in one line before any request uses it. The engine's host cache may drop
an idle adapter; the LoRARequest kept here lets it read the adapter again on its next use."""
from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import Field

from kvslim.engine.llm_engine import LLMEngine
from kvslim.errors import InvalidRequestError, KvslimError
from kvslim.lora.adapter import CONFIG_FILE
from kvslim.lora.request import LoRARequest
from kvslim.server.context import LoRAModels, ServerContext, ServerOptions
from kvslim.server.errors import OpenAIError
from kvslim.server.protocol import NonEmpty, _Request
from kvslim.server.responses import ModelCard


def parse_module(spec: str) -> tuple[str, str]:
    """One --lora-modules entry: NAME=PATH, or vLLM's JSON {"name": ..., "path": ...}."""
    if spec.lstrip().startswith("{"):
        try:
            entry = json.loads(spec)
            name, path = entry["name"], entry["path"]
        except (ValueError, KeyError, TypeError):
            raise KvslimError(f"--lora-modules: {spec!r} is not a JSON object with \"name\" "
                              f"and \"path\"") from None
    else:
        name, _, path = spec.partition("=")
    if not (isinstance(name, str) and isinstance(path, str) and name.strip() and path.strip()):
        raise KvslimError(f"--lora-modules: expected NAME=PATH, got {spec!r}")
    return name.strip(), path.strip()


def read_adapter(engine: LLMEngine, request: LoRARequest) -> None:
    """The engine reads and checks `request`'s directory (on its thread, or before it runs).
    Any failure is the directory's (unreadable, not peft's files): an InvalidRequestError."""
    try:
        engine.lora.add(request)
    except KvslimError:
        raise
    except Exception as e:                               # noqa: BLE001 - said in one line
        raise InvalidRequestError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}) "
                                  f"cannot be read: {type(e).__name__}: {e}",
                                  "lora_request") from None


def serve_lora_modules(engine: LLMEngine, options: ServerOptions, models: LoRAModels,
                       base_name: str) -> None:
    """The --lora-modules adapters, read and checked now (before the engine thread starts):
    a bad one, or LoRA options on an engine without LoRA, is a one-line KvslimError."""
    modules = options.lora_modules or []
    if (modules or options.allow_runtime_lora_updating) and engine.lora is None:
        flag = "--lora-modules" if modules else "--allow-runtime-lora-updating"
        raise KvslimError(f"{flag} needs an engine with LoRA adapters: add --enable-lora "
                          f"(and --max-loras, --max-lora-rank as the adapters need)")
    for spec in modules:
        name, path = parse_module(spec)
        if name == base_name or models.get(name) is not None:
            raise KvslimError(f"--lora-modules: the name {name!r} is given twice (the base "
                              f"model is {base_name!r})")
        request = models.new(name, path)
        try:
            read_adapter(engine, request)
        except KvslimError as e:
            raise KvslimError(f"--lora-modules: {e}") from None
        models.put(request)


def model_cards(ctx: ServerContext) -> list[ModelCard]:
    """The base model's card, then each adapter's (vLLM's root and parent fields)."""
    base = ModelCard(id=ctx.model_name, root=ctx.model_name, max_model_len=ctx.max_model_len)
    return [base] + [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=ctx.model_name,
                               max_model_len=ctx.max_model_len) for lora in ctx.loras]


class LoadLoRAAdapterRequest(_Request):
    lora_name: NonEmpty = Field(description="The name requests pass as `model`; one already "
                                            "served is a 400.")
    lora_path: NonEmpty = Field(description=f"A peft LoRA adapter directory on the server "
                                            f"({CONFIG_FILE} and its weights): a 404 where there "
                                            f"is none, a 400 for one the engine refuses.")


class UnloadLoRAAdapterRequest(_Request):
    lora_name: NonEmpty = Field(description="An adapter served as a model (a 404 otherwise); "
                                            "one that requests still run with is a 400.")


def found(path: str) -> bool:
    """Whether `path` holds a peft adapter at all (its config file)."""
    try:
        return (Path(path) / CONFIG_FILE).is_file()
    except (OSError, ValueError):                        # a name too long, a NUL byte
        return False


def lora_router(ctx: ServerContext) -> APIRouter:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora-updating);
    both answer a line of text, as vLLM's do. As there, a path without an adapter is a 404, an
    adapter the engine refuses a 400."""
    router = APIRouter()
    models = ctx.loras

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                 responses={200: {"description": "the adapter is served as a model"}})
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name = body.lora_name
        async with models.lock:
            if name == ctx.model_name or models.get(name) is not None:
                raise OpenAIError(400, f"The lora adapter {name!r} has already been loaded.",
                                  "lora_name")
            if not found(body.lora_path):
                raise OpenAIError(404, f"No adapter found for {body.lora_path!r}: no "
                                       f"{CONFIG_FILE} there (a peft LoRA adapter directory on "
                                       f"the server is expected)", "lora_path", "not_found")
            request = models.new(name, body.lora_path)
            try:
                await ctx.engine.call(lambda engine: read_adapter(engine, request))
            except KvslimError as e:                     # a directory the engine refuses
                raise OpenAIError(400, str(e), "lora_path") from None
            models.put(request)
        return PlainTextResponse(f"Success: LoRA adapter {name!r} added successfully.")

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                 responses={200: {"description": "the adapter is no longer served"}})
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        name = body.lora_name
        async with models.lock:
            request = models.by_name.pop(name, None)     # new requests no longer find it
            if request is None:
                raise OpenAIError(404, f"The lora adapter {name!r} cannot be found.",
                                  "lora_name", "not_found")
            try:
                await ctx.engine.call(lambda engine: engine.lora.remove(request.lora_int_id))
            except BaseException as e:
                models.put(request)                      # still served
                if isinstance(e, InvalidRequestError):   # requests still run with it
                    raise OpenAIError(400, f"The lora adapter {name!r} has unfinished "
                                           f"requests; unload it once they end.",
                                      "lora_name") from None
                raise
        return PlainTextResponse(f"Success: LoRA adapter {name!r} removed successfully.")

    return router
