"""The OpenAPI document the server publishes, made to tell the truth, since clients are
generated from it: FastAPI documents a 422 the server never sends (validation errors are
OpenAI-style 400s) and none of the errors it does send; /health's empty answer and /metrics'
Prometheus text are not JSON."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
# What each status means here; every API route may answer each one.
STATUSES = {"400": "invalid request (OpenAI-style error body)",
            "401": "missing or wrong API key (when the server has one)",
            "404": "unknown model (or stored response, LoRA adapter or adapter directory)",
            "500": "the request failed inside the engine",
            "503": "the engine is not running"}
OPEN_ROUTES = {"/health", "/metrics"}
# With stream=true: each server-sent event (OpenAPI 3.1: `schema` describes one event).
SSE = {"schema": {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a JSON chunk of the answer; the last event is [DONE]"}}}}
RESPONSES_SSE = {"schema": {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "description": "the event's type: response.created, "
              "response.output_text.delta, ..., response.completed or response.incomplete"},
    "data": {"type": "string", "description": "the event as JSON, with its type and "
             "sequence_number"}}}}
STREAMING = {"/v1/completions": SSE, "/v1/chat/completions": SSE,
             "/v1/responses": RESPONSES_SSE}
# The rules between fields that JSON Schema cannot state: said in words, answered with a 400.
RELATIONS = {"max_tokens": "The prompt's tokens, as the server renders it, plus max_tokens must "
                           "not exceed max_model_len ({max_model_len}); with a JSON output "
                           "constraint, max_tokens must hold its shortest document; a 400 "
                           "otherwise.",
             "min_tokens": "Must not exceed max_tokens; a 400 otherwise.",
             "tools": "Each function named once; a named tool_choice names one of them.",
             "tool_choice": "A named function must be one of tools' (a 400 otherwise)."}


def truthful_openapi(app: FastAPI, vocab_size: dict[str, int], max_model_len: int,
                     max_num_seqs: int, hidden_size: int) -> dict[str, Any]:
    """Also the served model's limits: token ids below its vocabulary size (`vocab_size`:
    the model's, "model", and the tokenizer's, "tokenizer"), max_tokens below max_model_len
    (that the prompt and max_tokens together fit is for the server to check), n and best_of
    up to max_num_seqs, an embedding's dimensions its hidden size."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _set_limits(schema, dict(vocab=vocab_size, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, hidden_size=hidden_size))
    schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = \
        ERROR_SCHEMA
    for path, item in schema["paths"].items():
        for operation in item.values():
            responses = operation["responses"]
            responses.pop("422", None)
            if path == "/health":
                responses["200"] = {"description": "healthy (an empty body)"}
                responses["503"] = _error(STATUSES["503"])
            elif path == "/metrics":
                responses["200"] = {"description": "Prometheus text format", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}
            else:
                responses.update({status: _error(text) for status, text in STATUSES.items()})
            if path in STREAMING:
                responses["200"].setdefault("content", {})["text/event-stream"] = \
                    STREAMING[path]
    schema["components"]["schemas"].pop("HTTPValidationError", None)
    schema["components"]["schemas"].pop("ValidationError", None)
    app.openapi_schema = schema
    return schema


def decimal_below(n: int) -> str:
    """A regex for the decimal integers 0..n-1 (leading zeros allowed, as int() reads them)."""
    top = str(n - 1)
    shorter = [f"[1-9][0-9]{{0,{len(top) - 2}}}"] if len(top) > 1 else []
    same = []
    for i, digit in enumerate(top):
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(digit) > low:
            same.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    return "^0*(" + "|".join(["0", *shorter, *same, top]) + ")$"


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR}}}


def _set_limits(node, limits: dict, key: str = "") -> None:
    if isinstance(node, list):
        for item in node:
            _set_limits(item, limits, key)
        return
    if not isinstance(node, dict):
        return
    vocab = node.pop("x-token-id", None)
    if vocab is not None:
        node["maximum"] = limits["vocab"][vocab] - 1
    vocab = node.pop("x-token-id-key", None)
    if vocab is not None:                          # a token id written as an object's key
        node["pattern"] = decimal_below(limits["vocab"][vocab])
    if node.pop("x-max-num-seqs", False):
        node["maximum"] = limits["max_num_seqs"]
    if node.pop("x-hidden-size", False):
        node["minimum"] = node["maximum"] = limits["hidden_size"]
    if key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        for branch in node.get("anyOf", [node]):
            if branch.get("type") == "integer":
                branch["maximum"] = limits["max_model_len"] - 1
        node["description"] = RELATIONS["max_tokens"].format(**limits)
    if key in ("min_tokens", "tools", "tool_choice") and "description" not in node:
        node["description"] = RELATIONS[key]
    for k, v in node.items():
        _set_limits(v, limits, k if k not in ("anyOf", "allOf") else key)
