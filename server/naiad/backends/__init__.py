"""Backend registry: backends found by entry point (group `naiad.backends`) or in a backend directory."""

from __future__ import annotations

import importlib
import logging
import threading
from importlib import metadata
from pathlib import Path

from ..errors import InvalidArgument, NaiadError
from .api import Backend

log = logging.getLogger("naiad.backends")

GROUP = "naiad.backends"
# The built-ins, as pyproject.toml registers them under GROUP. Used when the installed metadata predates an
# entry (a source checkout run with PYTHONPATH); tests check that both lists agree.
BUILTIN = {
    "fil": "naiad.backends.fil:backend",
    "llamacpp": "naiad.backends.llamacpp:backend",
    "onnxruntime": "naiad.backends.onnxruntime:backend",
    "python": "naiad.backends.python:backend",
    "pytorch": "naiad.backends.pytorch:backend",
    "tensorrt": "naiad.backends.tensorrt:backend",
}


class BackendRegistry:
    """Resolves a config's `backend` name to a Backend, initialising each backend once per process.

    Precedence: the backend directory (`--backend-directory`, Triton's python-based backend layout
    `<dir>/<name>/model.py`), then entry points of installed packages, then the built-in table.
    """

    def __init__(self, backend_directory: str | Path | None = None):
        self.directory = Path(backend_directory).resolve() if backend_directory else None
        self._loaded: dict[str, Backend] = {}
        self._lock = threading.Lock()

    def _entry_points(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for ep in metadata.entry_points(group=GROUP):
            if ep.name in found and found[ep.name] != ep.value:
                log.warning(
                    "backend '%s' is registered twice (%s and %s); using the first",
                    ep.name,
                    found[ep.name],
                    ep.value,
                )
                continue
            found.setdefault(ep.name, ep.value)
        return found

    def _directory_names(self) -> list[str]:
        if self.directory is None or not self.directory.is_dir():
            return []
        return sorted(p.parent.name for p in self.directory.glob("*/model.py"))

    def names(self) -> list[str]:
        """Every backend name a model may use."""
        return sorted(set(BUILTIN) | set(self._entry_points()) | set(self._directory_names()))

    def get(self, name: str) -> Backend:
        """The initialised backend called `name`; a load error naming the known ones when there is none."""
        with self._lock:
            backend = self._loaded.get(name)
            if backend is not None:
                return backend
            backend = self._resolve(name)
            if not backend.name:
                backend.name = name
            try:
                backend.initialize()
            except NaiadError:
                raise
            except Exception as exc:
                raise InvalidArgument(
                    f"backend '{name}' failed to initialize: {type(exc).__name__}: {exc}"
                ) from None
            self._loaded[name] = backend
            return backend

    def _resolve(self, name: str) -> Backend:
        from . import python  # noqa: F401  (a TritonPythonModel module may `import triton_python_backend_utils`)
        from .discovery import from_directory, from_object

        if self.directory is not None and name in self._directory_names():
            return from_directory(name, self.directory / name / "model.py")
        target = self._entry_points().get(name) or BUILTIN.get(name)
        if target is None:
            raise InvalidArgument(f"unsupported backend '{name}' (known backends: {', '.join(self.names())})")
        module_name, _, attr = target.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in filter(None, attr.split(".")):
                obj = getattr(obj, part)
        except Exception as exc:
            raise InvalidArgument(
                f"backend '{name}' ({target}) failed to import: {type(exc).__name__}: {exc}"
            ) from None
        return from_object(name, obj, target)

    def finalize(self) -> None:
        """TRITONBACKEND_Finalize for every backend initialised so far (at server stop)."""
        with self._lock:
            loaded, self._loaded = self._loaded, {}
        for name, backend in loaded.items():
            try:
                backend.finalize()
            except Exception:
                log.exception("backend '%s' failed to finalize", name)


_registry = BackendRegistry()


def configure(backend_directory: str | Path | None) -> BackendRegistry:
    """Replace the process's registry (the server does this once, from --backend-directory)."""
    global _registry
    _registry = BackendRegistry(backend_directory)
    return _registry


def registry() -> BackendRegistry:
    return _registry


def get(name: str) -> Backend:
    return _registry.get(name)


def names() -> list[str]:
    return _registry.names()
