"""A model repository in a local folder: read in place, changes detected from names, sizes and mtimes."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .base import ModelSource, RepositorySource

log = logging.getLogger("naiad.repository")


def numeric_versions(model_dir: Path) -> list[int]:
    out = []
    try:
        entries = list(os.scandir(model_dir))
    except OSError:
        return out
    for e in entries:
        if e.is_dir() and e.name.isdigit() and not e.name.startswith("0"):
            out.append(int(e.name))
    return sorted(out)


def tree_signature(model_dir: Path) -> tuple:
    """Cheap change detector for poll mode: names, sizes and mtimes of every file under the model."""
    sig = []
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            p = os.path.join(root, f)
            try:
                st = os.stat(p)
            except OSError:
                continue
            sig.append((os.path.relpath(p, model_dir), st.st_size, st.st_mtime_ns))
    return tuple(sorted(sig))


class LocalModel(ModelSource):
    def __init__(self, name: str, path: Path):
        self.name, self.path, self.uri = name, path, str(path)

    def versions(self) -> list[int]:
        return numeric_versions(self.path)

    def config_text(self) -> str | None:
        try:
            return (self.path / "config.pbtxt").read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def signature(self) -> tuple:
        return tree_signature(self.path)

    def fetch(self) -> Path:
        return self.path


class LocalRepository(RepositorySource):
    def __init__(self, path: str):
        self.path = Path(path).resolve()
        self.uri = str(self.path)

    def models(self) -> dict[str, ModelSource]:
        try:
            entries = sorted(os.scandir(self.path), key=lambda e: e.name)
        except OSError as exc:
            log.error("cannot read model repository %s: %s", self.path, exc)
            return {}
        return {
            e.name: LocalModel(e.name, Path(e.path))
            for e in entries
            if e.is_dir() and not e.name.startswith(".")
        }
