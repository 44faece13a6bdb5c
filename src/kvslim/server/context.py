"""`ServerContext`: what every route needs, built once per app (no module globals)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

from kvslim.engine.embedding import POOLING_METHODS
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError
from kvslim.lora.request import LoRARequest
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.server.async_engine import AsyncEngine, Prompt, RequestStream
from kvslim.server.errors import model_not_found
from kvslim.server.metrics import ServerMetrics
from kvslim.tools.format import ToolFormat
from kvslim.reasoning.parser import ReasoningFormat
from kvslim.tools.registry import (PARSER_CHOICES, REASONING_FORMATS, reasoning_format,
                                   tool_format)


def _option(default, help: str, choices: tuple | None = None, metavar: str | None = None):
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "metavar": metavar})


@dataclass
class ServerOptions:
    """How the server reads and shapes what the model writes, and the LoRA adapters it
    serves: one field per `kvslim serve` flag (cli/serve_cmds.py generates the flags from these
    fields)."""
    tool_call_parser: str = _option(
        "auto", "how tool calls are read from the model's text (auto: the chat template's own "
        "format where it is unambiguous, else hermes)",
        PARSER_CHOICES)
    reasoning_parser: str | None = _option(
        None, "return <think>...</think> as reasoning_content, apart from content",
        tuple(REASONING_FORMATS))
    pooling: str = _option(
        "last", "/v1/embeddings: the final normed hidden state of the last token, or its mean "
        "over the input; L2-normalised", POOLING_METHODS)
    responses_store_size: int = _option(
        256, "/v1/responses kept in memory for previous_response_id (the oldest dropped "
        "first; 0 keeps none)")
    lora_modules: list[str] | None = _option(
        None, "LoRA adapters served as models beside the base one, each NAME=PATH (a peft "
        "adapter directory), read at start; a request's `model` picks one (needs "
        "--enable-lora)", metavar="NAME=PATH")
    allow_runtime_lora_updating: bool = _option(
        False, "add POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which serve and "
        "drop adapters while the server runs (needs --enable-lora)")


class LoRAModels:
    """The adapters served, by name. Their lora_int_ids are 1, 2, ... in the order they were
    added, never given twice (an adapter loaded again is a new one to the prefix cache)."""

    def __init__(self) -> None:
        self.by_name: dict[str, LoRARequest] = {}
        self.last_id = 0
        self.lock = asyncio.Lock()               # runtime loads and unloads, one at a time

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self.by_name.values()))

    def new(self, name: str, path: str) -> LoRARequest:
        self.last_id += 1
        return LoRARequest(name, self.last_id, path)

    def put(self, request: LoRARequest) -> None:
        """Serve `request` (in id order, so /v1/models lists adapters as they were added)."""
        self.by_name[request.lora_name] = request
        self.by_name = dict(sorted(self.by_name.items(), key=lambda kv: kv[1].lora_int_id))


@dataclass
class ServerContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    api_key: str | None = None
    options: ServerOptions = field(default_factory=ServerOptions)
    loras: LoRAModels = field(default_factory=LoRAModels)    # adapters served as models
    hidden_size: int = 0                 # the model's: the width of /v1/embeddings' vectors

    def lora_request_of(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names: None for the base model (or no `model`);
        a name that is neither is a 404."""
        if name is None or name == self.model_name:
            return None
        lora = self.loras.get(name)
        if lora is None:
            raise model_not_found(name)
        return lora

    def model_name_of(self, lora: LoRARequest | None) -> str:
        """The name a response reports: the adapter's, or the base model's."""
        return lora.lora_name if lora is not None else self.model_name

    def check_base_model(self, name: str | None, what: str) -> None:
        """For what only the base model runs (`what`, e.g. "embeddings"): an adapter's name
        is a 400, an unknown name a 404."""
        if self.lora_request_of(name) is not None:
            raise InvalidRequestError(f"{what} run the base model {self.model_name!r}; "
                                      f"{name!r} is a LoRA adapter", "model")

    async def add(self, request_ids: list[str], prompts: list[Prompt], params: SamplingParams,
                  lora: LoRARequest | None) -> RequestStream:
        """AsyncEngine.add of one HTTP request's prompts, run with `lora`'s adapter if any."""
        if lora is None:
            return await self.engine.add(request_ids, prompts, params)
        return await self.engine.add(request_ids, prompts, params, lora_request=lora)

    @cached_property
    def tool_format(self) -> ToolFormat:
        """--tool-call-parser, "auto" read from the chat template once."""
        return tool_format(self.options.tool_call_parser, self.tokenizer.chat_template)

    @cached_property
    def reasoning(self) -> ReasoningFormat | None:
        """--reasoning-parser's convention, or None."""
        return reasoning_format(self.options.reasoning_parser)
