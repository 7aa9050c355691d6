"""Structured output for the llamacpp backend: vLLM's `structured_outputs` sampling parameter ({"json": schema},
{"json_object": true}, {"choice": [...]}, {"grammar": GBNF} or {"regex": pattern}) as the GBNF grammar that llama.cpp's grammar sampler
follows. A JSON schema is converted (llama-cpp-python's converter, pure Python) once per distinct schema: an LRU
cache keeps the last GRAMMAR_CACHE_SIZE grammars."""

from __future__ import annotations

import functools
import json
from typing import Any

from ...errors import InvalidArgument
from ...llm import structured_outputs
from . import gbnf_check
from .regex_grammar import regex_grammar

GRAMMAR_CACHE_SIZE = 64
#: vLLM's StructuredOutputsParams fields this backend follows (exactly one per request, as vLLM wants)
KINDS = ("json", "json_object", "choice", "grammar", "regex")
#: JSON schema keywords llama-cpp-python's converter passes over without enforcing them: a schema using one is
#: refused (as vLLM's xgrammar refuses them) rather than answered with output that breaks it
UNENFORCED = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "not",
        "if",
        "uniqueItems",
        "contains",
        "minProperties",
        "maxProperties",
        "patternProperties",
        "dependentRequired",
        "dependentSchemas",
    }
)
_NAMED_SCHEMAS = ("properties", "$defs", "definitions")  # their keys are names, their values schemas


def structured_grammar(value: Any) -> str | None:
    """The GBNF grammar for a `structured_outputs` value (its JSON text or the object), or None for none asked;
    anything llama.cpp cannot follow is InvalidArgument naming `structured_outputs`."""
    found = structured_outputs.read(value, KINDS, "llamacpp")
    if found is None:
        return None
    kind, spec = found
    if kind == "json_object":
        return _schema_grammar("{}")
    if kind == "json":
        schema = structured_outputs.json_schema(spec)
        unenforced = _unenforced(schema, "")
        if unenforced is not None:
            raise InvalidArgument(
                f"structured_outputs.json: llama.cpp's grammar cannot enforce the JSON schema keyword "
                f"'{unenforced[1]}' (at '{unenforced[0] or '/'}'): leave it out"
            )
        return _schema_grammar(json.dumps(schema, ensure_ascii=False))
    if kind == "regex":
        return _regex_grammar(spec)
    if kind == "choice":
        return "root ::= " + " | ".join(_literal(c) for c in structured_outputs.choices(spec)) + "\n"
    text = structured_outputs.grammar_text(spec)
    gbnf_check.check(text)  # what would crash llama.cpp never reaches it
    return text


def _unenforced(schema: Any, path: str, depth: int = 0) -> tuple[str, str] | None:
    """(where, keyword) of the first keyword in UNENFORCED in a schema, or None."""
    if depth > 64:
        raise InvalidArgument("structured_outputs.json: the JSON schema nests too deeply")
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = _unenforced(item, f"{path}/{i}", depth + 1)
            if found is not None:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in UNENFORCED:
            return path, key
        if key in ("enum", "const", "default", "examples", "required"):
            continue  # values, not schemas
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            for name, sub in value.items():
                found = _unenforced(sub, f"{path}/{key}/{name}", depth + 1)
                if found is not None:
                    return found
        elif isinstance(value, (dict, list)):
            found = _unenforced(value, f"{path}/{key}", depth + 1)
            if found is not None:
                return found
    return None


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _regex_grammar(pattern: Any) -> str:
    """regex_grammar, cached per pattern (a refused pattern raises and is not cached)."""
    text = regex_grammar(pattern)
    gbnf_check.check(text)  # a repeated group that can match nothing, (a*)*, would crash llama.cpp
    return text


def _literal(text: str) -> str:
    """A GBNF string literal matching `text` exactly."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _schema_grammar(schema_json: str) -> str:
    """The GBNF grammar of a JSON schema ("{}": any JSON object); a schema the converter cannot follow is
    InvalidArgument (a failure is not cached: lru_cache keeps only returned values)."""
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if schema_json == "{}":
        return JSON_GBNF  # its root is an object, as response_format json_object wants
    try:
        grammar = json_schema_to_gbnf(schema_json)
    except RecursionError:
        raise InvalidArgument("structured_outputs.json: the JSON schema nests too deeply") from None
    except (
        Exception
    ) as exc:  # the converter raises whatever its schema walk meets (KeyError, ValueError, ...)
        raise InvalidArgument(
            f"structured_outputs.json: llama.cpp cannot turn this JSON schema into a grammar: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    # the converter's string characters let control characters through, which JSON forbids unescaped (llama.cpp's
    # own converter excludes them)
    return grammar.replace(_LAX_CHAR, _JSON_CHAR)


_LAX_CHAR = 'char ::= [^"\\\\] |'
_JSON_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'
