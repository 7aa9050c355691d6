"""Backend registry: each backend module is imported only when a model needs it."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import InvalidArgument

_MODULES = {
    "onnxruntime": "naiad.backends.onnxruntime",
    "pytorch": "naiad.backends.pytorch",
    "python": "naiad.backends.python",
    "tensorrt": "naiad.backends.tensorrt",
}


def get(name: str) -> ModuleType:
    """The backend module for `name`; it provides `auto_complete(config, model_file)` and `create_instance`."""
    path = _MODULES.get(name)
    if path is None:
        raise InvalidArgument(f"unsupported backend '{name}' (supported: {', '.join(sorted(_MODULES))})")
    return importlib.import_module(path)


def names() -> list[str]:
    return sorted(_MODULES)
