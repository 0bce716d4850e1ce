"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the right HTTP status.

`APIError` is raised by handlers; `install_error_handlers(app)` turns it, FastAPI's validation errors (malformed
JSON, wrong types, out-of-range values: 400 naming the field), unknown routes (404) and wrong methods (405) into
that shape, and an unexpected exception into a 500 without a traceback in the body.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("hybridmoe.serve")

# OpenAI's error types by status
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


_TYPE_LABELS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _location(loc: tuple) -> str | None:
    """A pydantic error location -> the field as a client writes it: messages[0].content."""
    text = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif "[" not in part and "-" not in part and part not in _TYPE_LABELS:  # not a union branch's label
            text += ("." if text else "") + part
    return text or None


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                        code="invalid_json").response()
    param = _location(tuple(first.get("loc", ())))
    message = f"{param}: {first['msg']}" if param else first["msg"]
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param).response()


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s", request.url.path)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
