"""Triton vllm_backend's `multi_lora.json` (adapter name -> path, in a model's version folder) and what an adapter's
name may be: read alike by the llama.cpp and vLLM backends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument

FILE = "multi_lora.json"


def check_name(name: Any) -> str:
    """An adapter name as a request names it (`model`, `lora_name`) and vllm:lora_requests_info lists it (comma-
    separated): a non-empty string without commas, whitespace or control characters, of at most 256 characters."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument("a LoRA adapter's name must be a non-empty string")
    if len(name) > 256 or any(c == "," or c.isspace() or not c.isprintable() for c in name):
        raise InvalidArgument(
            f"LoRA adapter name {name[:64]!r} may not hold commas, whitespace or control characters (256 at most)"
        )
    return name


def read(version_dir: Path) -> list[tuple[str, Any]] | None:
    """The (name, path) entries of the version folder's multi_lora.json, in its order; None when there is none. A
    file that is not a JSON object is an InvalidArgument."""
    path = version_dir / FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{path} is not a JSON object of adapter names and paths: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{path} must be a JSON object of adapter names and paths")
    return list(doc.items())
