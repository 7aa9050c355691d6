"""Which server, event loop and metrics owner the model code on a thread talks to (bound by the python backend)."""

from __future__ import annotations

import threading
from typing import Any

_context = threading.local()
_default: dict[str, Any] = {}


def bind(server, loop, owner=None, model_dir: str | None = None) -> None:
    """On an instance thread: BLS and model control from this thread go to `server` on `loop`, and custom
    metrics created on it belong to `owner` (the instance; they go when it is unloaded). Threads the model
    starts itself use the last server bound, and their metrics stay for the server's lifetime. `model_dir` is
    what `pb_utils.get_model_dir()` answers there (the version folder, as Triton's stub does)."""
    _context.server = server
    _context.loop = loop
    _context.owner = owner
    _context.model_dir = model_dir
    _default["server"], _default["loop"], _default["model_dir"] = server, loop, model_dir


def keep_device_tensors(keep: bool) -> None:
    """On an instance thread: whether the model's GPU tensors stay on the GPU (FORCE_CPU_ONLY_INPUT_TENSORS "no")."""
    _context.device_tensors = keep


def device_tensors() -> bool:
    """Whether the model on the calling thread keeps GPU tensors on the GPU (default: no, host copies)."""
    return getattr(_context, "device_tensors", False)


def server():
    """The server the calling thread's model talks to, or None outside a running server."""
    return getattr(_context, "server", None) or _default.get("server")


def loop():
    """The event loop that server runs its requests on."""
    return getattr(_context, "loop", None) or _default.get("loop")


def owner():
    """What owns the custom metrics created on this thread (None: the server, for its lifetime)."""
    return getattr(_context, "owner", None)


def model_dir() -> str | None:
    """The version folder of the model whose code runs on this thread (or the one bound last)."""
    return getattr(_context, "model_dir", None) or _default.get("model_dir")
