"""OpenAI error objects and the FastAPI handlers that produce them.

Every failure leaves as `{"error": {"message", "type", "param", "code"}}`. A client
mistake is a 4xx naming the offending field (`param`); only our own faults are 5xx.
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.api.schema import ErrorDetail, ErrorResponse
from tokenmill.backend import BackendUnavailable, Overloaded
from tokenmill.fleet.worker_control import WorkerCommandRefused

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
# The SamplingParams / engine field names a ValueError message starts with.
_ENGINE_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                            "logprobs", "prompt", "presence_penalty", "frequency_penalty", "repetition_penalty",
                            "logit_bias", "response_format"})
# pydantic names union members in error locations ("str", "list[int]", "TextContentPart"); they
# are not part of the client's field path.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|.*[\[\]-].*|[A-Z].*)$")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type_, param=param, code=code)
        self.headers = headers or {}


def invalid_param(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(detail: ErrorDetail) -> dict[str, Any]:
    return ErrorResponse(error=detail).model_dump(mode="json")


def error_json(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.detail), status_code=error.status, headers=error.headers)


def field_path(loc: Sequence[int | str]) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content', dropping pydantic's union tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _TYPE_TAG.match(part):
            path += f".{part}" if path else part
    return path or None


def from_validation_errors(errors: Sequence[Any]) -> APIError:
    """The most specific error decides `param` (a union reports one error per member; the one that
    got deepest into the value is the useful one); the message lists a few for context."""
    if not errors:
        return invalid_param(None, "invalid request body")
    deepest = max(errors, key=lambda err: len(field_path(err.get("loc", ())) or ""))
    param = field_path(deepest.get("loc", ()))
    described = []
    for err in errors[:3]:
        where = field_path(err.get("loc", ())) or "body"
        described.append(f"{where}: {err.get('msg', 'invalid value')}")
    return invalid_param(param, "; ".join(described))


def from_value_error(exc: ValueError, aliases: dict[str, str] | None = None) -> APIError:
    """Map an engine/SamplingParams ValueError ("top_p must be in (0, 1]...") to a 400 naming the
    request field; `aliases` renames engine fields to the endpoint's (chat: prompt -> messages)."""
    message = str(exc)
    match = re.match(r"[a-z_]+", message)
    field = match.group(0) if match and match.group(0) in _ENGINE_FIELDS else None
    param = (aliases or {}).get(field, field) if field else None
    if field and param and param != field:  # speak the client's field name, not the engine's
        message = param + message[len(field):]
    code = "context_length_exceeded" if "context length" in message else None
    return invalid_param(param, message, code)


def overloaded_error(exc: Overloaded) -> APIError:
    retry_after = str(max(1, math.ceil(exc.retry_after)))
    return APIError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": retry_after})


def unavailable_error(exc: BackendUnavailable) -> APIError:
    return APIError(503, str(exc) or "no worker can serve the request", SERVER_ERROR, code="service_unavailable")


_REFUSAL_STATUS = {"invalid": 400, "not_found": 404, "conflict": 409}


def refused_error(exc: WorkerCommandRefused) -> APIError:
    return APIError(_REFUSAL_STATUS[exc.kind], str(exc), param=exc.param, code=exc.code)


def _http_error(status: int, message: str) -> APIError:
    type_ = SERVER_ERROR if status >= 500 else INVALID_REQUEST
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return APIError(status, message, type_, code=code)


def error_response(request: Request, exc: Exception,
                   count_error: Callable[[int], None] | None = None) -> JSONResponse:
    """The OpenAI error response for anything a route handler raised; `count_error(status)`
    sees the refusals the handlers raised themselves (for the request metrics)."""
    if isinstance(exc, APIError):
        if count_error is not None:
            count_error(exc.status)
        return error_json(exc)
    if isinstance(exc, RequestValidationError):
        return error_json(from_validation_errors(exc.errors()))
    if isinstance(exc, StarletteHTTPException):  # its headers too: a 405's Allow
        error = _http_error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        error.headers = dict(exc.headers or {})
        return error_json(error)
    if isinstance(exc, Overloaded):
        return error_json(overloaded_error(exc))
    if isinstance(exc, BackendUnavailable):
        return error_json(unavailable_error(exc))
    if isinstance(exc, WorkerCommandRefused):
        error = refused_error(exc)
        if count_error is not None:
            count_error(error.status)
        return error_json(error)
    log.exception("unhandled error serving %s %s", request.method, request.url.path, exc_info=exc)
    return error_json(APIError(500, "internal server error", SERVER_ERROR, code="internal_error"))


def install_error_handlers(app: FastAPI, count_error: Callable[[int], None] | None = None) -> None:
    """Route every exception a FastAPI route raises through `error_response`."""
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request, exc, count_error)

    for kind in (APIError, RequestValidationError, StarletteHTTPException, Overloaded, BackendUnavailable,
                 WorkerCommandRefused, Exception):
        app.add_exception_handler(kind, handle)
