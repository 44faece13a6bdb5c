"""POST /v1/embeddings, OpenAI's: one L2-normalised vector per input, pooled from the model's
final normed hidden states as `kvslim serve --pooling` says. The route runs what `LLM.embed`
runs (`LLMEngine.embed`, engine/embedding.py), on the engine thread between two steps."""
from __future__ import annotations

import base64
import struct
from typing import Annotated, Literal, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator

from kvslim.errors import InvalidRequestError
from kvslim.server.context import ServerContext
# _Request: the base every request body shares (strict types, unknown fields ignored).
from kvslim.server.protocol import NonEmpty, TokenIds, _int, _Request

MAX_INPUTS = 2048                  # inputs per request, OpenAI's limit


class EmbeddingRequest(_Request):
    input: Union[NonEmpty, Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_INPUTS)],
                 Annotated[TokenIds, Field(min_length=1)],
                 Annotated[list[Annotated[TokenIds, Field(min_length=1)]],
                           Field(min_length=1, max_length=MAX_INPUTS)]] = Field(
        description="A string, a list of strings, a list of token ids or a list of such lists; "
                    "each input, as the server tokenizes it, at most max_model_len tokens (GET "
                    "/v1/models says it), a 400 otherwise.")
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    # The model's width only (server/openapi.py publishes it): vectors are never truncated.
    dimensions: Optional[_int(ge=1, json_schema_extra={"x-hidden-size": True})] = Field(
        None, description="Only the model's hidden size: embeddings are not truncated.")
    user: Optional[str] = None

    @field_validator("input", mode="before")
    @classmethod
    def _said_plainly(cls, value):
        """The union's own messages for these name a branch it tried, not the problem."""
        if value in ("", []) or (isinstance(value, list) and any(v in ("", []) for v in value)):
            raise ValueError("must not be empty, nor hold an empty input")
        if isinstance(value, list) and len(value) > MAX_INPUTS and not isinstance(value[0], int):
            raise ValueError(f"holds {len(value)} inputs, more than {MAX_INPUTS}")
        return value

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: a string or a list of ids."""
        if isinstance(self.input, str) or isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str] = Field(
        description="The floats; with encoding_format base64, base64 of their little-endian "
                    "float32 bytes.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


async def create_embeddings(ctx: ServerContext, request: EmbeddingRequest) -> JSONResponse:
    ctx.check_base_model(request.model, "embeddings")
    hidden_size = ctx.hidden_size
    if request.dimensions is not None and request.dimensions != hidden_size:
        raise InvalidRequestError(f"dimensions: this model's embeddings have {hidden_size} "
                                  f"dimensions and are not truncated; got {request.dimensions}",
                                  "dimensions")
    inputs, pooling = request.inputs(), ctx.options.pooling
    outputs = await ctx.engine.call(lambda engine: engine.embed(inputs, pooling))
    data = [Embedding(index=i, embedding=encode(out.embedding, request.encoding_format))
            for i, out in enumerate(outputs)]
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return JSONResponse(EmbeddingResponse(data=data, model=ctx.model_name, usage=usage)
                        .model_dump())


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """As OpenAI sends it: the floats, or base64 of their little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
