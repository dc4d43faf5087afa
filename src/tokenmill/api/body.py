"""Reading a request body: a size limit (413), JSON syntax (400) and the schema (400 naming the field).

Route handlers parse bodies themselves instead of letting FastAPI do it, so each kind
of client mistake gets its own precise OpenAI error and no body is buffered past the
limit.
"""
from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from tokenmill.api.errors import APIError, from_validation_errors, invalid_param

ModelT = TypeVar("ModelT", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:  # chunked uploads declare no length
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise APIError(400, "client disconnected while sending the body") from exc
    return b"".join(chunks)


def json_of(raw: bytes) -> Any:
    """A free-form JSON body (the admin endpoints check its fields themselves)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise invalid_param(None, f"body is not JSON: {exc.msg}") from exc


async def parse_body(request: Request, schema: type[ModelT], max_bytes: int) -> ModelT:
    raw = await read_body(request, max_bytes)
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors and errors[0]["type"] == "json_invalid":
            raise invalid_param(None, f"the request body is not valid JSON: {errors[0]['msg']}") from exc
        raise from_validation_errors(errors) from exc
