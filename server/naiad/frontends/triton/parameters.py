"""Request parameters shared by the HTTP and gRPC frontends (priority, timeout, sequence controls).

In JSON (HTTP, the generate extension) the reserved parameters have Triton's types: `priority`, `timeout` and an
output's `classification` unsigned integers, `sequence_id` an unsigned integer or a string, `sequence_start`,
`sequence_end`, `binary_data_output` and an output's `binary_data` booleans. Triton answers anything else with 500
and its parser's words, Naiad with 400 and the same words (a body it cannot read is the client's error:
tests/test_triton_compare.py, DELIBERATE_DIFFERENCES). gRPC parameters carry their kind, which grpc/codec.py
checks as Triton does before the values come here."""

from __future__ import annotations

from ...errors import InvalidArgument
from ...inference import SEQUENCE_END, SEQUENCE_START, InferenceRequest


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


def parameters_of(doc: dict, kind: str = "", name: str = "") -> dict:
    """A JSON object's `parameters` (absent or null: none); anything but an object is the client's error (`kind` and
    `name`: the input's or output's, for the message)."""
    params = doc.get("parameters")
    if type(params) is dict:
        return params
    if params is None:
        return {}
    raise InvalidArgument(f"{kind} '{name}': 'parameters' must be a JSON object" if kind else _NOT_AN_OBJECT)


_NOT_AN_OBJECT = "'parameters' must be a JSON object"


def _sequence_id(value: object) -> int | str:
    if not isinstance(value, str) and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise InvalidArgument("Unable to parse 'sequence_id': attempt to access JSON non-string as string")
    return value


def request_options(request: InferenceRequest, params: dict, strict: bool = True) -> None:
    """Move Triton's reserved request parameters onto the request; the rest stay for the model. With `strict`
    False (the generate extension, whose parameters Triton passes on whatever their types) one of the wrong type is
    an ordinary parameter, not an error."""
    if not params:
        return
    for key in _RESERVED.keys() & params.keys():
        try:
            _RESERVED[key](request, params[key])
        except InvalidArgument:
            if strict:
                raise


def _set_flag(flag: int, key: str):
    def apply(request: InferenceRequest, value: object) -> None:
        if boolean(value, key):
            request.flags |= flag

    return apply


_RESERVED = {
    "priority": lambda r, v: setattr(r, "priority", unsigned(v, "priority")),
    "timeout": lambda r, v: setattr(r, "timeout_us", unsigned(v, "timeout")),
    "sequence_id": lambda r, v: setattr(r, "correlation_id", _sequence_id(v)),
    "sequence_start": _set_flag(SEQUENCE_START, "sequence_start"),
    "sequence_end": _set_flag(SEQUENCE_END, "sequence_end"),
}
