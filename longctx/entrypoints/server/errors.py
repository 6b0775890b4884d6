"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Owns: ``APIError`` (raised by handlers and the request gate), turning FastAPI's validation
errors (422 by default) into 400s that name the bad field, and the handlers that make every
error response (404 routes, 405 methods, 500s) use the same shape.
Never: deciding what is valid; handlers and ``protocol`` do that.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
# the code of an error raised without one: every error body names a code a client can switch on
DEFAULT_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                 413: "request_too_large", 429: "rate_limit_exceeded", 500: "internal_error",
                 503: "engine_unavailable"}


class APIError(Exception):
    """A request the server refuses, with the status and OpenAI error fields to answer with."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        code = code or DEFAULT_CODES.get(status, "http_error")
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _param(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first of pydantic's errors as a 400 naming its field."""
    first = errors[0]
    kind, loc = first.get("type", ""), tuple(first.get("loc", ()))
    more = f" ({len(errors) - 1} more problem(s) in the request)" if len(errors) > 1 else ""
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    param = _param(loc)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        if kind == "value_error":
            return bad_request(msg + more)
        if kind == "missing":
            return bad_request("the request body is missing: send a JSON object", code="invalid_json")
        return bad_request("the request body must be a JSON object (Content-Type: application/json)",
                           code="invalid_json")
    if kind == "missing":
        return bad_request(f"'{param}' is required", param=param, code="missing_required_parameter")
    got = f" (got {_short(first['input'])})" if "input" in first and kind != "value_error" else ""
    return bad_request(f"invalid '{param}': {msg}{got}{more}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(list(err.errors())).response()

    @app.exception_handler(ValidationError)
    async def _invalid_model(_: Request, err: ValidationError) -> JSONResponse:
        return validation_error(err.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /v1/models, /health, /metrics"
        elif err.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(err.detail)
        return APIError(err.status_code, message, code=None, headers=err.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error while serving a request")
        return APIError(500, f"internal server error: {type(err).__name__}: {err}",
                        type="server_error").response()
