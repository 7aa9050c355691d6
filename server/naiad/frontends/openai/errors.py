"""OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`) and the status codes it goes with."""

from __future__ import annotations

import orjson

from ...errors import NaiadError, NotFound, as_naiad_error
from ..llm.errors import LLMError


def error_type(status: int) -> str:
    """OpenAI's `type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_object(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI error object) for any error a request met."""
    if isinstance(exc, LLMError):
        status, message, param, code = exc.status, exc.message, exc.param, exc.code
    else:
        err: NaiadError = as_naiad_error(exc)
        status, message, param = err.http_status, err.message, None
        code = "model_not_found" if isinstance(err, NotFound) else None
        if status == 499:  # cancelled: no such status in OpenAI's API
            status = 400
    body = {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}
    return status, body


def error_bytes(exc: BaseException) -> tuple[int, bytes]:
    status, body = error_object(exc)
    return status, orjson.dumps(body)
