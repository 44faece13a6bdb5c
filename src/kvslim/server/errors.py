"""Every error the server returns has OpenAI's body: {"error": {"message", "type", "param",
"code"}}. Clients (the `openai` package among them) parse that body into their exceptions, so
FastAPI's own shapes (422 validation lists, {"detail": ...}) are translated here."""
from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvslim.errors import InvalidRequestError, KvslimError

logger = logging.getLogger("kvslim.server")

# OpenAI's error types by status; 404s for models are "invalid_request_error" there too.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          503: "service_unavailable", 500: "server_error"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def invalid(e: InvalidRequestError | KvslimError) -> OpenAIError:
    return OpenAIError(400, str(e), getattr(e, "param", None))


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model {name!r} does not exist", "model", "model_not_found")


def engine_dead() -> OpenAIError:
    return OpenAIError(503, "the engine loop is not running", code="engine_dead")


def request_failed(error: str) -> OpenAIError:
    """The engine ended the request on an internal fault of its own (the server goes on)."""
    return OpenAIError(500, f"the request failed inside the engine: {error}",
                       code="request_failed")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(KvslimError)
    async def _kvslim(request: Request, e: KvslimError):     # InvalidRequestError included
        return invalid(e).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return validation_error(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        message = e.detail if isinstance(e.detail, str) else HTTPStatus(e.status_code).phrase
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        # Starlette's 405 carries the Allow header RFC 9110 requires: keep it.
        return OpenAIError(e.status_code, message).response(e.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return OpenAIError(500, f"internal server error: {type(e).__name__}").response()


def validation_error(errors: list[dict]) -> OpenAIError:
    """FastAPI's validation errors (wrong types, missing fields, malformed JSON) -> one 400.
    `param` is the top-level field, as OpenAI reports it."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"request body is not valid JSON: {first.get('msg')}")
    param = loc[0] if loc else None
    # Pydantic names the union branch it tried ("str", "list[int]"); users only need the field.
    where = ".".join(p for p in loc if "[" not in p and p not in ("str", "int", "float", "bool"))
    message = first.get("msg", "invalid value")
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    return OpenAIError(400, f"{where}: {message}" if where else message, param)
