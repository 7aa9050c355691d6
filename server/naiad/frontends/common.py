"""Request parameters shared by the HTTP and gRPC frontends (priority, timeout, sequence controls)."""

from __future__ import annotations

from ..errors import InvalidArgument
from ..inference import SEQUENCE_END, SEQUENCE_START, InferenceRequest


def _int(params: dict, key: str, default: int = 0) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.lstrip("-").isdigit():
            return int(value)
        raise InvalidArgument(f"parameter '{key}' must be an integer")
    return value


def request_options(request: InferenceRequest, params: dict) -> None:
    """Move Triton's reserved request parameters onto the request; the rest stay for the model."""
    if not params:
        return
    if "priority" in params:
        request.priority = _int(params, "priority")
    if "timeout" in params:
        request.timeout_us = _int(params, "timeout")
    if "sequence_id" in params:
        seq = params["sequence_id"]
        if isinstance(seq, bool) or not isinstance(seq, (int, str)):
            raise InvalidArgument("parameter 'sequence_id' must be an unsigned integer or a string")
        request.correlation_id = seq
    flags = 0
    if params.get("sequence_start"):
        flags |= SEQUENCE_START
    if params.get("sequence_end"):
        flags |= SEQUENCE_END
    request.flags |= flags
