"""`ServerContext`: what every route needs, built once per app (no module globals)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from kvslim.engine.embedding import POOLING_METHODS
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.server.async_engine import AsyncEngine
from kvslim.server.errors import model_not_found
from kvslim.server.metrics import ServerMetrics
from kvslim.tools.format import ToolFormat
from kvslim.reasoning.parser import ReasoningFormat
from kvslim.tools.registry import (PARSER_CHOICES, REASONING_FORMATS, reasoning_format,
                                   tool_format)


def _option(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ServerOptions:
    """How the server reads and shapes what the model writes: one field per `kvslim serve`
    flag (cli/serve_cmds.py generates the flags from these fields)."""
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


@dataclass
class ServerContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    api_key: str | None = None
    options: ServerOptions = field(default_factory=ServerOptions)

    def check_model(self, name: str | None) -> None:
        """A request may omit `model`; if it names one, it must be the one we serve."""
        if name is not None and name != self.model_name:
            raise model_not_found(name)

    @cached_property
    def tool_format(self) -> ToolFormat:
        """--tool-call-parser, "auto" read from the chat template once."""
        return tool_format(self.options.tool_call_parser, self.tokenizer.chat_template)

    @cached_property
    def reasoning(self) -> ReasoningFormat | None:
        """--reasoning-parser's convention, or None."""
        return reasoning_format(self.options.reasoning_parser)
