"""The Python backend API: Triton's TRITONBACKEND lifecycle (backend, model, instance) and execute helpers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .. import config as cfg
from ..config import ModelConfig, data_type_name
from ..errors import Internal, InvalidArgument, NaiadError, NotFound, Unavailable, Unsupported, as_naiad_error
from ..inference import InferenceRequest, InferenceResponse, OutputTensor
from ..tensors import config_to_wire, datatype_of
from .base import InlinePolicy, ModelContext, ModelInstance, Timing

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelInstanceGroup

# The errors a backend raises or passes to InstanceState.error(): each maps to its HTTP status and gRPC code.
__all__ = [
    "Backend",
    "Batch",
    "InferenceRequest",
    "InferenceResponse",
    "InstanceState",
    "Internal",
    "InvalidArgument",
    "ModelState",
    "NotFound",
    "ResponseSender",
    "Unavailable",
    "Unsupported",
]


class ModelState:
    """One model version as a backend sees it (TRITONBACKEND_Model plus the backend's ModelState).

    `state` is the backend's own slot: whatever `model_initialize` puts there (a loaded file, a tokenizer)
    is shared by every instance of the version.
    """

    def __init__(self, ctx: ModelContext, backend: Backend):
        self.ctx = ctx
        self.backend = backend
        self.state: Any = None
        self._instances = 0
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.ctx.name

    @property
    def version(self) -> int:
        return self.ctx.version

    @property
    def config(self) -> ModelConfig:
        """The normalised ModelConfig (Triton's protobuf message); read it, do not change it."""
        return self.ctx.config

    def config_dict(self) -> dict:
        """The config as Triton's JSON (what TRITONBACKEND_ModelConfig serialises)."""
        return cfg.to_dict(self.ctx.config)

    @property
    def repository_path(self) -> Path:
        """The model's directory (TRITONBACKEND_ModelRepository)."""
        return self.ctx.model_dir

    @property
    def version_path(self) -> Path:
        return self.ctx.version_dir

    @property
    def model_file(self) -> Path | None:
        """The file in the version folder this backend reads, or None when it reads none."""
        name = self.backend.model_filename(self.ctx.config)
        return self.ctx.version_dir / name if name else None

    @property
    def parameters(self) -> dict[str, str]:
        """The config's `parameters` as strings (Triton's string_value)."""
        return {k: v.string_value for k, v in self.ctx.config.parameters.items()}

    @property
    def max_batch_size(self) -> int:
        return self.ctx.config.max_batch_size

    @property
    def decoupled(self) -> bool:
        return self.ctx.config.model_transaction_policy.decoupled


class InstanceState:
    """One model instance (TRITONBACKEND_ModelInstance plus the backend's ModelInstanceState), with the
    helpers every execute needs. Its methods run on the instance's own thread."""

    def __init__(self, model: ModelState, group: ModelInstanceGroup, device_id: int, name: str):
        self.model = model
        self.group = group
        self.device_id = device_id
        self.name = name
        self.state: Any = None
        self.timing: Timing | None = None  # set around each execute by the server
        self._compute_start = 0
        self._output_types = {
            o.name: config_to_wire(data_type_name(o.data_type)) for o in model.config.output
        }
        self._all_outputs = [o.name for o in model.config.output]
        # read on every execution: the config does not change while the version is loaded
        self._batched = model.max_batch_size > 0
        self._version = str(model.version)

    @property
    def kind(self) -> Literal["CPU", "GPU"]:
        return "GPU" if self.group.kind == mc.ModelInstanceGroup.KIND_GPU else "CPU"

    @property
    def instance_count(self) -> int:
        """How many instances the model has in all (to share the cores among them)."""
        return sum(g.count * max(1, len(g.gpus)) for g in self.model.config.instance_group) or 1

    # ---- execute helpers ----
    def requested_outputs(self, requests: list[InferenceRequest]) -> list[str]:
        """The union of the outputs the requests ask for (all config outputs when one asks for none)."""
        names: list[str] = []
        for r in requests:
            if not r.outputs:
                return list(self._all_outputs)
            for o in r.outputs:
                if o.name not in names:
                    names.append(o.name)
        return names

    def gather(self, requests: list[InferenceRequest], names: list[str] | None = None) -> Batch:
        """Stack the requests' inputs along the batch dimension into contiguous arrays."""
        t0 = time.monotonic_ns()
        batched = self._batched
        sizes = [r.batch_size(batched) for r in requests]
        keys = names if names is not None else list(requests[0].inputs)
        if len(requests) == 1:
            inputs = {n: requests[0].inputs[n] for n in keys if n in requests[0].inputs}
        elif not batched:
            raise InvalidArgument(
                f"model '{self.model.name}' does not batch (max_batch_size 0): execute one request at a time"
            )
        else:
            inputs = {}
            for n in keys:
                parts = [r.inputs[n] for r in requests if n in r.inputs]
                if len(parts) != len(requests):
                    raise InvalidArgument(f"input '{n}' is missing from some requests of the batch")
                inputs[n] = np.concatenate(parts, axis=0)
        batch = Batch(inputs, sizes, self.requested_outputs(requests))
        if self.timing is not None:
            self.timing.input_ns += time.monotonic_ns() - t0
            self._compute_start = time.monotonic_ns()
        return batch

    def scatter(
        self, requests: list[InferenceRequest], batch: Batch, outputs: dict[str, np.ndarray]
    ) -> list[InferenceResponse]:
        """Split batched outputs back into one response per request, each with the outputs it asked for."""
        t0 = time.monotonic_ns()
        if self.timing is not None and self._compute_start:
            self.timing.infer_ns += t0 - self._compute_start
            self._compute_start = 0
        if len(requests) == 1:
            responses = [self.response(requests[0], outputs)]
        else:
            total = batch.total
            for name, arr in outputs.items():
                if arr.ndim == 0 or arr.shape[0] != total:
                    raise InvalidArgument(
                        f"model '{self.model.name}' output '{name}' has shape {list(arr.shape)}, which "
                        f"does not have the batch size {total} along its first dimension"
                    )
            responses = []
            offset = 0
            for r, n in zip(requests, batch.sizes):
                responses.append(self.response(r, {k: v[offset : offset + n] for k, v in outputs.items()}))
                offset += n
        if self.timing is not None:
            self.timing.output_ns += time.monotonic_ns() - t0
        return responses

    def response(self, request: InferenceRequest, outputs: dict[str, np.ndarray]) -> InferenceResponse:
        """A response carrying the outputs `request` asked for (all config outputs when it named none)."""
        names = [o.name for o in request.outputs] if request.outputs else list(outputs)
        tensors = []
        for name in names:
            arr = outputs.get(name)
            if arr is None:
                raise InvalidArgument(f"model '{self.model.name}' has no output '{name}'")
            tensors.append(OutputTensor(name, datatype_of(arr, self._output_types.get(name)), arr))
        return InferenceResponse(
            model_name=self.model.name, model_version=self._version, outputs=tensors, id=request.id
        )

    def error(self, request: InferenceRequest, error: BaseException | str) -> InferenceResponse:
        """A response that fails this request alone (the rest of the batch still succeeds)."""
        exc = Internal(error) if isinstance(error, str) else as_naiad_error(error)
        return InferenceResponse(
            model_name=self.model.name, model_version=self._version, id=request.id, error=exc
        )

    def sender(self, request: InferenceRequest) -> ResponseSender:
        """The response sender of a request to a decoupled model (TRITONBACKEND_ResponseFactory)."""
        return ResponseSender(self, request)


@dataclass
class Batch:
    """Inputs of several requests stacked along the first dimension; `sizes` says how many rows each has."""

    inputs: dict[str, np.ndarray]
    sizes: list[int]
    outputs: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.sizes)


class ResponseSender:
    """Sends zero or more responses for one request of a decoupled model, then a final flag."""

    def __init__(self, instance: InstanceState, request: InferenceRequest):
        self._instance = instance
        self._request = request
        self._closed = False
        self._lock = threading.Lock()

    def send(
        self,
        outputs: dict[str, np.ndarray] | None = None,
        *,
        error: BaseException | str | None = None,
        final: bool = False,
    ) -> None:
        """Send outputs (or an error) and/or close the stream with `final=True`."""
        with self._lock:
            if self._closed:
                raise InvalidArgument("the response sender is closed: a final response was sent already")
            self._closed = final
        deliver = self._request.response_callback
        if deliver is None:
            raise InvalidArgument("this request does not accept decoupled responses")
        inst, req = self._instance, self._request
        if error is not None:
            resp = inst.error(req, error)
        elif outputs is not None:
            resp = inst.response(req, outputs)
        elif final:
            resp = InferenceResponse(
                model_name=inst.model.name, model_version=str(inst.model.version), id=req.id
            )
        else:
            raise InvalidArgument("send() needs outputs, an error, or final=True")
        resp.final = final
        deliver(resp)

    def is_cancelled(self) -> bool:
        return self._request.cancelled


class Backend:
    """A backend: subclass it, override the hooks you need, and register an instance (or the class) under
    the entry-point group `naiad.backends`. Each hook mirrors a TRITONBACKEND_* function; see docs/backends.md.

    Threads: `initialize`/`finalize` run once per server process; `model_*` and `auto_complete_config` run
    on the loader thread; `instance_initialize`, `instance_execute` and `instance_finalize` run on the
    instance's own thread, so one instance never executes two batches at once.
    """

    name: str = ""
    #: file each version folder must hold, unless the config names another (None: no file is required)
    default_model_filename: str | None = None
    #: fast synchronous backends may execute on the event loop (see base.InlinePolicy)
    allow_inline: bool = False

    # ---- TRITONBACKEND_Initialize / Finalize ----
    def initialize(self) -> None:
        """Once per process, before the first model of this backend loads."""

    def finalize(self) -> None:
        """Once, when the server stops."""

    # ---- model ----
    def model_filename(self, config: ModelConfig) -> str | None:
        """The model file name in a version folder: the config's default_model_filename or the backend's."""
        return config.default_model_filename or self.default_model_filename

    def auto_complete_config(self, config: ModelConfig, model_file: Path | None) -> None:
        """Fill what config.pbtxt leaves out (inputs, outputs, max_batch_size) from the model file."""

    def model_initialize(self, model: ModelState) -> None:
        """TRITONBACKEND_ModelInitialize: validate the config, load what instances share into model.state."""

    def model_finalize(self, model: ModelState) -> None:
        """TRITONBACKEND_ModelFinalize: after the last instance of the version has finalized."""

    # ---- instance ----
    def instance_initialize(self, instance: InstanceState) -> None:
        """TRITONBACKEND_ModelInstanceInitialize: open the engine for instance.kind/device_id."""

    def instance_finalize(self, instance: InstanceState) -> None:
        """TRITONBACKEND_ModelInstanceFinalize."""

    def instance_execute(
        self, instance: InstanceState, requests: list[InferenceRequest]
    ) -> list[InferenceResponse] | None:
        """TRITONBACKEND_ModelInstanceExecute: one response per request, in order (use instance.error()
        for one that failed). Decoupled models send through instance.sender(request) and return None.
        Raising fails every request of the batch."""
        raise Internal(f"backend '{self.name}' does not implement instance_execute")

    # ---- how the server drives the hooks ----
    def create_instance(self, ctx: ModelContext, group, device_id: int, index: int) -> ModelInstance:
        """The server's side of the lifecycle; backends that own their threads may override it."""
        return LifecycleInstance(self, ctx, group, device_id, index)


class LifecycleInstance(ModelInstance):
    """Drives a Backend's hooks for one instance: model state shared per version, counted, finalized last."""

    def __init__(self, backend: Backend, ctx: ModelContext, group, device_id: int, index: int):
        super().__init__(ctx, group, device_id, index)
        self.backend = backend
        # Instances of one version are created one after another on the loader thread.
        model = ctx.extra.get("backend_model")
        if model is None:
            model = ModelState(ctx, backend)
            _call_hook(backend.model_initialize, model, f"model '{ctx.name}': model_initialize")
            ctx.extra["backend_model"] = model
        with model._lock:
            model._instances += 1
        self.model = model
        self.state = InstanceState(model, group, device_id, self.name)
        self._decoupled = model.decoupled  # read on every execution; the config does not change while loaded
        self.inline = InlinePolicy(backend.allow_inline and not self._decoupled)
        self._initialized = False

    def warmup_thread_init(self) -> None:
        if not self._initialized:
            what = f"model '{self.ctx.name}' instance {self.name}: instance_initialize"
            _call_hook(self.backend.instance_initialize, self.state, what)
            self._initialized = True

    def execute(self, requests, timing):
        state = self.state
        state.timing = timing
        t0 = time.monotonic_ns()
        try:
            result = self.backend.instance_execute(state, requests)
        finally:
            state.timing = None
        measured = timing.input_ns + timing.infer_ns + timing.output_ns
        if not measured:  # the backend used no helper: all of it was compute
            timing.infer_ns += time.monotonic_ns() - t0
        if self._decoupled:
            if result is not None:
                raise Internal(
                    f"model '{self.ctx.name}' is decoupled: instance_execute must return None and send "
                    "responses with instance.sender(request)"
                )
            return [None] * len(requests)
        if result is None:
            raise Internal(f"model '{self.ctx.name}': instance_execute returned no responses")
        if len(result) != len(requests):
            raise Internal(
                f"model '{self.ctx.name}': execute returned {len(result)} responses for {len(requests)} requests"
            )
        out = []
        for req, resp in zip(requests, result):
            if isinstance(resp, BaseException):
                resp = state.error(req, resp)
            elif not isinstance(resp, InferenceResponse):
                raise Internal(
                    f"model '{self.ctx.name}': execute must return InferenceResponse objects, "
                    f"got {type(resp).__name__}"
                )
            out.append(resp)
        return out

    def close(self) -> None:
        try:
            if self._initialized:
                self._initialized = False
                self.backend.instance_finalize(self.state)
        finally:
            with self.model._lock:
                self.model._instances -= 1
                last = self.model._instances == 0
                if last:
                    self.ctx.extra.pop("backend_model", None)
            if last:
                self.backend.model_finalize(self.model)


def _call_hook(hook, arg, what: str) -> None:
    """Run a load-time hook; what it raises becomes a load error that names the hook."""
    try:
        hook(arg)
    except NaiadError:
        raise
    except Exception as exc:
        raise InvalidArgument(f"{what} failed: {type(exc).__name__}: {exc}") from None


class ModelFileBackend(Backend):
    """A backend whose model is a file: the config is completed from it by `auto_complete(config, model_file)`
    (not called when the version has no file), and each instance keeps its engine in `instance.state`."""

    def auto_complete(self, config: ModelConfig, model_file: Path) -> None:
        """Fill what config.pbtxt leaves out from the model file."""

    def auto_complete_config(self, config: ModelConfig, model_file: Path | None) -> None:
        if model_file is not None:
            self.auto_complete(config, model_file)

    def instance_finalize(self, instance: InstanceState) -> None:
        instance.state = None


class ModuleBackend(ModelFileBackend):
    """A backend that creates its own ModelInstance objects (the built-ins whose engines own threads,
    processes or GPU buffers): `auto_complete(config, model_file)` and `create_instance(ctx, group, device,
    index)` replace the lifecycle hooks."""

    def __init__(
        self,
        name: str,
        auto_complete: Callable[[ModelConfig, Path], None],
        create_instance: Callable[..., ModelInstance],
        default_model_filename: str,
    ):
        self.name = name
        self._auto_complete = auto_complete
        self._create = create_instance
        self.default_model_filename = default_model_filename

    def auto_complete(self, config: ModelConfig, model_file: Path) -> None:
        self._auto_complete(config, model_file)

    def create_instance(self, ctx, group, device_id, index):
        return self._create(ctx, group, device_id, index)
