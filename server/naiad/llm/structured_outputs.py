"""vLLM's `structured_outputs` sampling parameter read once for every engine: its JSON text or object, exactly one kind
({"json"}, {"json_object"}, {"choice"}, {"grammar"}, {"regex"}, ...) and that kind's value, with clear errors."""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidArgument


def read(value: Any, supported: tuple[str, ...], backend: str) -> tuple[str, Any] | None:
    """(kind, value) of a `structured_outputs` value, or None when nothing is asked; InvalidArgument naming
    `structured_outputs` for malformed input, a kind `backend` does not follow, or more or less than one kind."""
    if value in (None, "", b""):
        return None
    spec = value
    if isinstance(value, (str, bytes)):
        try:
            spec = json.loads(value)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(
                f"sampling parameter 'structured_outputs' is not valid JSON: {exc}"
            ) from None
    if not isinstance(spec, dict):
        raise InvalidArgument("sampling parameter 'structured_outputs' must be a JSON object")
    asked = [k for k, v in spec.items() if v is not None and v is not False]
    for key in asked:
        if key not in supported and key in KNOWN:
            raise InvalidArgument(
                f"structured_outputs.{key} is not supported by the {backend} backend: use one of "
                f"{', '.join(supported)}"
            )
    kinds = [k for k in asked if k in supported]
    if len(kinds) != 1:
        raise InvalidArgument(
            f"sampling parameter 'structured_outputs' must hold exactly one of {', '.join(supported)}, got "
            f"{', '.join(asked) or 'none'}"
        )
    return kinds[0], spec[kinds[0]]


#: vLLM's StructuredOutputsParams kinds
KNOWN = ("json", "json_object", "choice", "grammar", "regex", "structural_tag")


def json_schema(value: Any) -> dict:
    """The schema of {"json": ...}: an object, or its JSON text (vLLM takes both)."""
    schema = value
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except ValueError as exc:
            raise InvalidArgument(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidArgument("structured_outputs.json must be a JSON schema (an object)")
    return schema


def choices(value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise InvalidArgument("structured_outputs.choice must be a non-empty list of strings")
    return value


def grammar_text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(
            "structured_outputs.grammar must be a GBNF grammar (a string with a 'root' rule)"
        )
    return value
