"""A loaded model version: its normalised config, instances, scheduler and statistics; request validation."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2 as mc

from .backends.base import ModelContext
from .config import data_type_name
from .errors import InvalidArgument
from .inference import InferenceRequest, InferenceResponse
from .scheduling.pool import InstancePool
from .scheduling.scheduler import Scheduler
from .stats import ModelStats
from .tensors import config_to_wire


@dataclass(slots=True)
class TensorSpec:
    name: str
    datatype: str  # wire name: FP32, BYTES, ...
    dims: tuple[int, ...]  # without the batch dimension
    optional: bool = False
    reshape: tuple[int, ...] | None = None


def _specs(tensors) -> dict[str, TensorSpec]:
    out = {}
    for t in tensors:
        reshape = tuple(t.reshape.shape) if t.HasField("reshape") else None
        out[t.name] = TensorSpec(
            t.name,
            config_to_wire(data_type_name(t.data_type)),
            tuple(t.dims),
            getattr(t, "optional", False),
            reshape,
        )
    return out


class ModelVersion:
    """One servable version. `infer` validates the request and hands it to the scheduler (`pool` is None for
    an ensemble, whose scheduler runs other models)."""

    def __init__(self, ctx: ModelContext, pool: InstancePool | None, scheduler: Scheduler):
        self.ctx = ctx
        self.name = ctx.name
        self.version = ctx.version
        self.config: mc.ModelConfig = ctx.config
        self.pool = pool
        self.scheduler = scheduler
        self.stats: ModelStats = scheduler.stats
        self.inputs = _specs(ctx.config.input)
        self.outputs = _specs(ctx.config.output)
        self.max_batch_size = ctx.config.max_batch_size
        self.decoupled = ctx.config.model_transaction_policy.decoupled
        self.is_python = ctx.config.backend == "python"
        # `reshape` (config.pbtxt): the shape the model sees instead of `dims`, batch dimension kept.
        self.input_reshape = {n: s.reshape for n, s in self.inputs.items() if s.reshape is not None}
        self.output_reshape = {n: s.dims for n, s in self.outputs.items() if s.reshape is not None}
        self._required = tuple(s.name for s in self.inputs.values() if not s.optional)

    def metadata(self, versions: list[str]) -> dict:
        def entry(spec: TensorSpec) -> dict:
            shape = list(spec.dims)
            if self.max_batch_size > 0:
                shape = [-1] + shape
            return {"name": spec.name, "datatype": spec.datatype, "shape": shape}

        platform = self.config.platform or self.config.backend
        return {
            "name": self.name,
            "versions": versions,
            "platform": platform,
            "inputs": [entry(s) for s in self.inputs.values()],
            "outputs": [entry(s) for s in self.outputs.values()],
        }

    def validate(self, request: InferenceRequest) -> None:
        """Check names, datatypes, shapes and batch size against the config, as Triton does."""
        name = self.name
        batch = None
        for in_name, arr in request.inputs.items():
            spec = self.inputs.get(in_name)
            if spec is None:
                raise InvalidArgument(
                    f"[request id: {request.id or '<id_unknown>'}] unexpected inference input '{in_name}' "
                    f"for model '{name}'"
                )
            dt = request.datatypes.get(in_name)
            if dt != spec.datatype:
                raise InvalidArgument(
                    f"[request id: {request.id or '<id_unknown>'}] inference input '{in_name}' data-type is "
                    f"'{dt}', but model '{name}' expects '{spec.datatype}'"
                )
            shape = arr.shape
            if self.max_batch_size > 0:
                if len(shape) < 1:
                    raise InvalidArgument(
                        f"[request id: {request.id or '<id_unknown>'}] inference input '{in_name}' has no "
                        f"batch dimension; model '{name}' supports batching so the first dimension is the "
                        "batch size"
                    )
                b = shape[0]
                if batch is None:
                    batch = b
                elif b != batch:
                    raise InvalidArgument(
                        f"[request id: {request.id or '<id_unknown>'}] input '{in_name}' batch size {b} does "
                        f"not match other inputs' batch size {batch} for model '{name}'"
                    )
                shape = shape[1:]
            if not _shape_matches(shape, spec.dims):
                full = ([-1] if self.max_batch_size > 0 else []) + list(spec.dims)
                got = list(arr.shape)
                note = ""
                if self.max_batch_size > 0:
                    note = (
                        "NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
                        "dimension to be prepended to each input shape. If you want to specify the full "
                        "shape including the batch dim in your input dims config, try setting "
                        "max_batch_size to zero. See the model configuration docs for more info on "
                        "max_batch_size."
                    )
                raise InvalidArgument(
                    f"[request id: {request.id or '<id_unknown>'}] unexpected shape for input '{in_name}' for "
                    f"model '{name}'. Expected {_fmt(full)}, got {_fmt(got)}. {note}"
                )
        if self.max_batch_size > 0 and batch is not None:
            if batch < 1 or batch > self.max_batch_size:
                raise InvalidArgument(
                    f"[request id: {request.id or '<id_unknown>'}] inference request batch-size must be <= "
                    f"{self.max_batch_size} for '{name}'"
                )
        for required in self._required:
            if required not in request.inputs:
                raise InvalidArgument(
                    f"[request id: {request.id or '<id_unknown>'}] expected {len(self._required)} inputs "
                    f"but got {len(request.inputs)} inputs for model '{name}'. Got input(s) "
                    f"{_names(request.inputs)}, but missing required input(s) "
                    f"{_names([s for s in self._required if s not in request.inputs])}. "
                    "Please provide all required input(s)."
                )
        if self.outputs or not self.is_python:
            for out in request.outputs:
                if out.name not in self.outputs:
                    raise InvalidArgument(f"unexpected inference output '{out.name}' for model '{name}'")
                if out.classification and self.outputs[out.name].datatype == "BYTES":
                    raise InvalidArgument(
                        f"classification is not supported for BYTES output '{out.name}' of model '{name}'"
                    )

    async def infer(self, request: InferenceRequest) -> InferenceResponse | None:
        if self.input_reshape:
            self.reshape_inputs(request)
        return await self.scheduler.submit(request)

    def reshape_inputs(self, request: InferenceRequest) -> None:
        """Give the model its inputs in their configured `reshape` shape (validation saw `dims`)."""
        batched = self.max_batch_size > 0
        for name, shape in self.input_reshape.items():
            arr = request.inputs.get(name)
            if arr is not None:
                target = ((arr.shape[0],) if batched else ()) + shape
                try:
                    request.inputs[name] = arr.reshape(target)
                except ValueError:
                    raise InvalidArgument(
                        f"input '{name}' of shape {_fmt(arr.shape)} cannot be reshaped to {_fmt(target)} "
                        f"for model '{self.name}'"
                    ) from None

    def reshape_outputs(self, response: InferenceResponse) -> None:
        """Give the client outputs with `reshape` in their configured `dims` (the model made `reshape`)."""
        batched = self.max_batch_size > 0
        for out in response.outputs:
            dims = self.output_reshape.get(out.name)
            if dims is None or dims.count(-1) > 1:
                continue  # more than one variable dimension: no single shape to restore
            data = out.data
            target = ((data.shape[0],) if batched and data.ndim else ()) + dims
            try:
                out.data = data.reshape(target)
            except ValueError:
                raise InvalidArgument(
                    f"output '{out.name}' of shape {_fmt(data.shape)} from model '{self.name}' cannot be "
                    f"reshaped to its configured dims {_fmt(target)}"
                ) from None

    async def close(self, timeout: float | None = None) -> None:
        await self.scheduler.close(timeout)
        if self.pool is not None:
            # off the event loop: an execution still awaited there (past `timeout`, or its caller cancelled)
            # finishes on the loop, and its instance's `close` waits for it
            await asyncio.get_running_loop().run_in_executor(None, self.pool.close)


def _shape_matches(shape, dims) -> bool:
    if len(shape) != len(dims):
        return False
    for s, d in zip(shape, dims):  # (a loop, not all() over a generator: this runs on every request)
        if d != -1 and d != s:
            return False
    return True


def _fmt(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _names(names) -> str:
    return "[" + ",".join(f"'{n}'" for n in names) + "]"
