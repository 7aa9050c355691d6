"""What a plug-in may provide (a Backend, a TritonPythonModel module, two functions) made into a Backend."""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import types
from pathlib import Path

from ..errors import InvalidArgument
from .api import Backend
from .base import ModelContext, ModelInstance
from .python.instance import PythonInstance, add_search_path, load_module, run_auto_complete

_module_ids = itertools.count()


class PythonModelBackend(Backend):
    """Triton's python-based backend: one module with `TritonPythonModel`, used by every model naming it.

    A module found in a backend directory is imported afresh for each model version (Triton gives each
    model its own stub process, so models never share the module's globals); an installed one is shared.
    """

    default_model_filename = None  # the model's version folder needs no model.py

    def __init__(self, name: str, module: types.ModuleType | None = None, path: Path | None = None):
        self.name = name
        self.module = module
        self.path = path

    def _module(self, model_name: str):
        if self.module is not None:
            return self.module
        return load_module(self.path, model_name, self.path.parent)

    def auto_complete_config(self, config, model_file):
        run_auto_complete(config, self._module(config.name))

    def create_instance(self, ctx: ModelContext, group, device_id: int, index: int) -> ModelInstance:
        if "python_module" not in ctx.extra:
            ctx.extra["python_module"] = self._module(ctx.name)
        return PythonInstance(ctx, group, device_id, index)


def from_object(name: str, obj, where: str) -> Backend:
    """A Backend from what an entry point names: a Backend (instance or class), a module exporting
    `backend`, a module or class `TritonPythonModel`."""
    if isinstance(obj, Backend):
        return obj
    if isinstance(obj, type) and issubclass(obj, Backend):
        return obj()
    if isinstance(obj, types.ModuleType):
        if hasattr(obj, "backend"):
            return from_object(name, obj.backend, where)
        if hasattr(obj, "TritonPythonModel"):
            return PythonModelBackend(name, module=obj)
    if inspect.isclass(obj) and callable(getattr(obj, "execute", None)):
        return PythonModelBackend(name, module=types.SimpleNamespace(TritonPythonModel=obj))
    raise InvalidArgument(
        f"backend '{name}' ({where}) is neither a naiad Backend nor a module with TritonPythonModel"
    )


def from_directory(name: str, model_py: Path) -> Backend:
    """A backend directory's `<name>/model.py`: a native Backend (`backend = ...`) or a TritonPythonModel."""
    spec = importlib.util.spec_from_file_location(f"naiad_backend_{name}_{next(_module_ids)}", model_py)
    module = importlib.util.module_from_spec(spec)
    add_search_path(model_py.parent)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise InvalidArgument(
            f"backend '{name}': failed to import {model_py}: {type(exc).__name__}: {exc}"
        ) from None
    if hasattr(module, "backend"):
        return from_object(name, module.backend, str(model_py))
    if hasattr(module, "TritonPythonModel"):
        return PythonModelBackend(name, path=model_py)
    raise InvalidArgument(f"backend '{name}': {model_py} defines neither `backend` nor TritonPythonModel")
