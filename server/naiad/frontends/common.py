"""Request parameters shared by the HTTP and gRPC frontends (priority, timeout, sequence controls).

In JSON (HTTP, the generate extension) the reserved parameters have Triton's types: `priority`, `timeout` and an
output's `classification` unsigned integers, `sequence_id` an unsigned integer or a string, `sequence_start`,
`sequence_end`, `binary_data_output` and an output's `binary_data` booleans. Triton answers anything else with 500
and its parser's words, Naiad with 400 and the same words (a body it cannot read is the client's error:
tests/test_triton_compare.py, DELIBERATE_DIFFERENCES). gRPC parameters carry their kind, which grpc_codec checks as
Triton does before the values come here."""

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


def boolean(value: object, key: str) -> bool:
    """A JSON parameter that must be a boolean, with Triton's words for one that is not."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"Unable to parse '{key}': attempt to access JSON non-boolean as boolean")
    return value


def parameters_of(doc: dict, what: str = "") -> dict:
    """A JSON object's `parameters` (absent or null: none); anything but an object is the client's error."""
    params = doc.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidArgument(f"{what}'parameters' must be a JSON object")
    return params


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
        if not isinstance(seq, str) and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 0):
            raise InvalidArgument(
                "Unable to parse 'sequence_id': attempt to access JSON non-string as string"
            )
        request.correlation_id = seq
    flags = 0
    if "sequence_start" in params and boolean(params["sequence_start"], "sequence_start"):
        flags |= SEQUENCE_START
    if "sequence_end" in params and boolean(params["sequence_end"], "sequence_end"):
        flags |= SEQUENCE_END
    request.flags |= flags
