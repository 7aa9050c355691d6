"""The python backend: `model.py` with `TritonPythonModel`, in-process or in worker processes
(`naiad.python_isolation` decides which).

Modules: `instance` (the in-process instance), `wire` (the format both sides of a worker speak), `process` (the
server side of a worker), `serving` (what the server does for a worker's requests), `worker` (the worker
process), `triton_python_backend_utils` (the public API models import), `context` and `convert` (its glue to the
server). `process` and `worker` know each other only through
`wire`; this package joins them by handing `worker.main` to each `ProcessInstance`.
"""

from __future__ import annotations

import sys

from ...device_tensors import force_cpu_only
from ...python_isolation import execution_isolation
from ..api import ModuleBackend
from ..base import ModelContext, ModelInstance
from . import triton_python_backend_utils, worker
from .instance import PythonInstance, auto_complete
from .process import ProcessInstance

# Models do `import triton_python_backend_utils as pb_utils`.
sys.modules.setdefault("triton_python_backend_utils", triton_python_backend_utils)


def create_instance(ctx: ModelContext, group, device_id: int, index: int) -> ModelInstance:
    """In-process or in a worker process, as `python_isolation.execution_isolation` decides for the model."""
    force_cpu_only(ctx.config)  # a value other than "yes" or "no" fails the load, as in Triton
    if execution_isolation(ctx.config) == "process":
        return ProcessInstance(ctx, group, device_id, index, worker.main)
    return PythonInstance(ctx, group, device_id, index)


# Registered under the entry-point group naiad.backends (pyproject.toml).
backend = ModuleBackend("python", auto_complete, create_instance, "model.py")
