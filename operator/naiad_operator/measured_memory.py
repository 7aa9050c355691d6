"""The memory placement counts for each model: what the pool's servers measured it to hold once loaded (the largest
figure any pod reports), the InferenceModel's declared `memory` until a server has measured it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .control import IndexEntry


def measured_memory(index: Mapping[str, Iterable[IndexEntry] | None]) -> dict[str, int]:
    """Server model name -> the largest measured bytes over the pods' repository indexes (unreadable ones skipped)."""
    out: dict[str, int] = {}
    for entries in index.values():
        for entry in entries or ():
            if entry.ready and entry.memory_bytes is not None:
                out[entry.name] = max(out.get(entry.name, 0), entry.memory_bytes)
    return out


def placement_memory(declared: int, model_name: str, measured: Mapping[str, int]) -> int:
    """The bytes placement reserves for a model: measured when a server has measured it, else declared."""
    return measured.get(model_name, declared)
