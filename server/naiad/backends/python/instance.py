"""The in-process python model instance: `model.py`'s `TritonPythonModel`, run on the instance's thread."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import itertools
import json
import sys
import time
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ... import config as cfg
from ... import device_tensors
from ...config import ModelConfig
from ...custom_metrics import CustomMetrics
from ...errors import Internal, InvalidArgument, NaiadError
from ...inference import InferenceResponse
from ..base import InlinePolicy, ModelContext, ModelInstance
from . import context
from . import triton_python_backend_utils as pb_utils
from .convert import naiad_error, to_native

_module_ids = itertools.count()


def add_search_path(folder: Path) -> None:
    """Let a python-based backend's model.py import the modules beside it (vllm_backend's `from utils.metrics
    import ...`), as Triton's stub puts the backend folder on sys.path. First, so that no installed package of the
    same name shadows them."""
    entry = str(folder)
    if entry not in sys.path:
        sys.path.insert(0, entry)


def load_module(model_file: Path, model_name: str, search_path: Path | None = None):
    """Import model.py under a unique module name, so versions and models never share globals; `search_path`
    (a backend directory's `<name>/` folder) goes on sys.path first."""
    if not model_file.is_file():
        raise InvalidArgument(f"model '{model_name}': {model_file} not found")
    if search_path is not None:
        add_search_path(search_path)
    unique = f"naiad_model_{next(_module_ids)}"
    spec = importlib.util.spec_from_file_location(unique, model_file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise InvalidArgument(
            f"model '{model_name}': failed to import {model_file}: {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(module, "TritonPythonModel"):
        raise InvalidArgument(f"model '{model_name}': {model_file} defines no class TritonPythonModel")
    return module


def _uses_bls(module) -> bool:
    """Whether model.py builds BLS requests or controls models (then it must never execute on the event loop,
    which serves those calls)."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return True
    return any(
        call in source
        for call in (
            "InferenceRequest(",
            ".exec(",
            "async_exec",
            "load_model(",
            "unload_model(",
            "is_model_ready(",
        )
    )


def auto_complete(config: ModelConfig, model_file: Path) -> None:
    """Run `TritonPythonModel.auto_complete_config` of `model_file` when the model defines it."""
    run_auto_complete(config, load_module(model_file, config.name))


def run_auto_complete(config: ModelConfig, module) -> None:
    """Run the `TritonPythonModel.auto_complete_config` of an imported module, when it defines one."""
    hook = getattr(module.TritonPythonModel, "auto_complete_config", None)
    if hook is None:
        return
    wrapper = pb_utils.ModelConfig(cfg.to_dict(config))
    try:
        result = hook(wrapper)
    except Exception as exc:
        raise InvalidArgument(f"model '{config.name}': auto_complete_config failed: {exc}") from None
    data = (result or wrapper).as_dict()
    completed = cfg.parse_json(data, f"auto-completed config of model '{config.name}'")
    config.CopyFrom(completed)


class PythonInstance(ModelInstance):
    def __init__(self, ctx: ModelContext, group, device_id: int, index: int):
        super().__init__(ctx, group, device_id, index)
        module = ctx.extra.get("python_module")
        if module is None:
            module = ctx.extra["python_module"] = load_module(ctx.model_file, ctx.name)
        self.model = module.TritonPythonModel()
        self.decoupled = ctx.config.model_transaction_policy.decoupled
        # FORCE_CPU_ONLY_INPUT_TENSORS "no": GPU inputs arrive as GPU tensors, GPU outputs stay on the GPU
        self.device_tensors = device_tensors.takes_device_inputs(ctx.config)
        self.all_outputs = [o.name for o in ctx.config.output]
        # numpy has no bfloat16: uint16 words are BF16 where the config says so
        self.bf16_outputs = {o.name for o in ctx.config.output if o.data_type == mc.TYPE_BF16}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._initialized = False
        self.metrics_owner = object()  # what owns the custom metrics this instance creates
        # Inline execution on the event loop is for plain synchronous models only: BLS needs the loop to be
        # free, async execute needs its own loop, decoupled models may block until they have sent everything,
        # and a model keeping GPU tensors needs its thread's setting (context.keep_device_tensors).
        self.inline = InlinePolicy(
            not self.decoupled
            and not self.device_tensors
            and not inspect.iscoroutinefunction(self.model.execute)
            and not _uses_bls(module)
        )

    def _initialize(self) -> None:
        # TRITONSERVER_InstanceGroupKindString: vllm_backend takes KIND_MODEL ("MODEL") for multi-GPU engines
        kind = {mc.ModelInstanceGroup.KIND_GPU: "GPU", mc.ModelInstanceGroup.KIND_MODEL: "MODEL"}.get(
            self.group.kind, "CPU"
        )
        args = {
            "model_config": json.dumps(cfg.to_dict(self.ctx.config)),
            "model_instance_kind": kind,
            "model_instance_name": self.name,
            "model_instance_device_id": str(self.device_id),
            "model_repository": str(self.ctx.model_dir),
            "model_version": str(self.ctx.version),
            "model_name": self.ctx.name,
        }
        init = getattr(self.model, "initialize", None)
        if init is not None:
            try:
                self._call(init, args)
            except Exception as exc:
                raise InvalidArgument(
                    f"model '{self.ctx.name}': initialize failed: {type(exc).__name__}: {exc}"
                ) from None
        self._initialized = True

    def warmup_thread_init(self) -> None:
        context.bind(self.ctx.server, self.ctx.loop, self.metrics_owner, str(self.ctx.version_dir))
        context.keep_device_tensors(self.device_tensors)
        if not self._initialized:
            self._initialize()

    def _call(self, fn, *args):
        result = fn(*args)
        if result.__class__ is not list and inspect.isawaitable(result):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            result = self._loop.run_until_complete(result)
        return result

    def execute(self, requests, timing):
        t0 = time.monotonic_ns()
        pb_requests = [
            pb_utils.InferenceRequest._incoming(r, [o.name for o in r.outputs] or self.all_outputs)
            for r in requests
        ]
        try:
            result = self._call(self.model.execute, pb_requests)
        except pb_utils.TritonModelException as exc:
            raise Internal(exc.message() or str(exc)) from None
        except pb_utils.TritonError as exc:
            raise naiad_error(exc) from None
        except NaiadError:
            raise
        except Exception as exc:
            raise Internal(
                f"Failed to process the request(s) for model '{self.name}', message: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        timing.infer_ns += time.monotonic_ns() - t0
        if self.decoupled:
            if result is not None:
                raise Internal(
                    f"model '{self.ctx.name}' is decoupled: execute must return None and send "
                    "responses with the response sender"
                )
            return [None] * len(requests)
        if not isinstance(result, (list, tuple)) or len(result) != len(requests):
            got = len(result) if isinstance(result, (list, tuple)) else type(result).__name__
            raise Internal(
                f"model '{self.ctx.name}': execute returned {got} responses for {len(requests)} requests"
            )
        responses: list[InferenceResponse] = []
        for pb_req, _native, resp in zip(pb_requests, requests, result):
            if not isinstance(resp, pb_utils.InferenceResponse):
                raise Internal(
                    f"model '{self.ctx.name}': execute must return InferenceResponse objects, "
                    f"got {type(resp).__name__}"
                )
            out = to_native(pb_req, resp, True)
            for t in out.outputs:
                if t.datatype == "UINT16" and t.name in self.bf16_outputs:
                    t.datatype = "BF16"
            if resp.has_error():
                out.error = naiad_error(resp.error())
            responses.append(out)
        return responses

    def close(self) -> None:
        fin = getattr(self.model, "finalize", None)
        try:
            if fin is not None and self._initialized:
                self._call(fin)
        finally:
            if self._loop is not None:
                self._loop.close()
            store = getattr(self.ctx.server, "custom_metrics", None)
            if isinstance(store, CustomMetrics):  # in a worker, the server releases the worker's instance
                store.release(self.metrics_owner)
