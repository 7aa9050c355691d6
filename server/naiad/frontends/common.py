"""Request parameters shared by the HTTP and gRPC frontends (priority, timeout, sequence controls).

In JSON (HTTP, the generate extension) `priority`, `timeout` and an output's `classification` are unsigned integers,
as Triton reads them; Triton answers anything else with 500 and its parser's words, Naiad with 400 and the same
words (a body it cannot read is the client's error: tests/test_triton_compare.py, DELIBERATE_DIFFERENCES). gRPC
parameters carry their kind, which grpc_codec checks as Triton does before the values come here."""

from __future__ import annotations

from ..errors import InvalidArgument
from ..inference import SEQUENCE_END, SEQUENCE_START, InferenceRequest


def unsigned(value: object, key: str, verb: str = "parse") -> int:
    """A JSON parameter that must be an unsigned integer, with Triton's words for one that is not."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(
            f"Unable to {verb} '{key}': attempt to access JSON non-unsigned-integer as unsigned-integer"
        )
    return value


def request_options(request: InferenceRequest, params: dict) -> None:
    """Move Triton's reserved request parameters onto the request; the rest stay for the model."""
    if not params:
        return
    if "priority" in params:
        request.priority = unsigned(params["priority"], "priority")
    if "timeout" in params:
        request.timeout_us = unsigned(params["timeout"], "timeout")
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
