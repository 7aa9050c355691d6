"""What a backend provides: model instances that execute lists of requests on their own thread (or await them on
the event loop)."""

from __future__ import annotations

import abc
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import ModelConfig, data_type_name
from ..errors import InvalidArgument
from ..inference import InferenceRequest, InferenceResponse, OutputTensor
from ..tensors import config_to_wire, datatype_of

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelInstanceGroup


@dataclass
class ModelContext:
    """Everything an instance needs to know about the model version it serves."""

    name: str
    version: int
    config: ModelConfig
    model_dir: Path
    version_dir: Path
    server: Any = None  # naiad.server.Server, for BLS
    loop: Any = None  # the server's event loop
    extra: dict = field(default_factory=dict)

    @property
    def model_file(self) -> Path:
        return self.version_dir / self.config.default_model_filename

    @property
    def batched(self) -> bool:
        return self.config.max_batch_size > 0


@dataclass(slots=True)
class Timing:
    """Compute time of one execution, split as Triton's statistics do."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0


class InlinePolicy:
    """Decides whether a fast, synchronous instance may execute on the event loop instead of its own thread.

    Why: a thread hop costs two GIL hand-offs per execution; with the server on one core that ping-pong was
    62% of the time of a 16-value python identity request (py-spy, bench/README.md). A model qualifies after
    `QUALIFY` executions whose moving average stays under `LIMIT_NS`, and goes back to its thread when two
    executions in a row take longer than `EVICT_NS`, so a model that turns slow stalls the event loop for at
    most two executions, or when the average of its inline executions passes twice `LIMIT_NS` (a batched model
    that qualified on small batches and now executes large ones).

    Wall time counts the time the thread was not running too. One slow execution alone is what a preemption
    looks like (another process on the core) or a CPU limit's throttling (a pod's CFS quota spent: the whole
    process waits for the next period, tens of milliseconds): not the model. So a lone one neither evicts nor
    enters the average, and no execution adds more than `CLIP_NS` to it (a few preemptions of a millisecond
    or two in a row do not make a 10 µs model look slow). Evicting on them sent the instance to its thread
    after nearly every throttled period, which under a CPU limit cost a small model a large part of its
    requests/s (bench/README.md, "Inline executions under a CPU limit").
    """

    QUALIFY = 32
    LIMIT_NS = 150_000
    EVICT_NS = 2_000_000
    CLIP_NS = 4 * LIMIT_NS

    __slots__ = ("_avg", "_count", "_slow", "allowed", "inline")

    def __init__(self, allowed: bool):
        self.allowed = allowed
        self.inline = False
        self._avg = 0.0
        self._count = 0
        self._slow = False  # the last inline execution took longer than EVICT_NS

    def observe(self, ns: int) -> None:
        if not self.allowed:
            return
        if ns > self.CLIP_NS:
            if ns > self.EVICT_NS and self.inline:
                if not self._slow:
                    self._slow = True  # alone it is not the model's: see the class's docstring
                    return
                self._evict()
                return
            ns = self.CLIP_NS
        if self.inline:
            self._slow = False
            # back to its thread when the executions have grown (a dynamic batcher composing larger batches
            # than the ones the model qualified with)
            self._avg = 0.8 * self._avg + 0.2 * ns
            if self._avg > 2 * self.LIMIT_NS:
                self._evict()
            return
        self._avg = ns if self._count == 0 else 0.8 * self._avg + 0.2 * ns
        self._count += 1
        if self._count >= self.QUALIFY and self._avg < self.LIMIT_NS:
            self.inline = True

    def _evict(self) -> None:
        self.inline = self._slow = False
        self._count = 0  # (the next execution, on its thread, starts the average again)

    def forbid(self) -> None:
        self.allowed = False
        self.inline = False


class ModelInstance(abc.ABC):
    """One instance of a model (an `instance_group` member). `execute` runs on the instance's own thread,
    or on the event loop when its `inline` policy allows it (see InlinePolicy)."""

    def __init__(self, ctx: ModelContext, group: ModelInstanceGroup, device_id: int, index: int):
        self.ctx = ctx
        self.group = group
        self.device_id = device_id
        self.index = index
        self.name = f"{group.name}_{index}"
        self.inline = InlinePolicy(False)

    @abc.abstractmethod
    def execute(self, requests: list[InferenceRequest], timing: Timing) -> list[InferenceResponse]:
        """Run a list of requests; return one response per request (an error response is allowed)."""

    def execute_async(
        self, requests: list[InferenceRequest], timing: Timing
    ) -> Awaitable[list[InferenceResponse | None]] | None:
        """Called on the event loop: an awaitable execution that needs no thread of this process (a model that runs
        in a worker process answers when the worker replies), or None when this execution runs on the instance's
        thread (the default)."""
        return None

    def warmup_thread_init(self) -> None:
        """Called once on the instance's thread before the first execution."""

    def ready(self) -> bool:
        """Whether the instance can serve now (the model's readiness asks every instance)."""
        return True

    def close(self) -> None:
        """Release the engine; called once when the model version unloads."""


class TensorInstance(ModelInstance):
    """A backend that runs a tensor graph: requests are stacked along the batch dimension, run once, split."""

    def __init__(self, ctx, group, device_id, index):
        super().__init__(ctx, group, device_id, index)
        self.output_types = {o.name: config_to_wire(data_type_name(o.data_type)) for o in ctx.config.output}
        self.all_outputs = [o.name for o in ctx.config.output]

    @abc.abstractmethod
    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """Run the engine on (batched) inputs and return the named outputs."""

    def execute(self, requests, timing):
        t0 = time.monotonic_ns()
        wanted = self._wanted_outputs(requests)
        if len(requests) == 1:
            inputs = requests[0].inputs
            sizes = None
        else:
            sizes = [r.batch_size(True) for r in requests]
            inputs = {
                name: np.concatenate([r.inputs[name] for r in requests], axis=0)
                for name in requests[0].inputs
            }
        t1 = time.monotonic_ns()
        results = self.run(inputs, wanted)
        t2 = time.monotonic_ns()
        responses = []
        if sizes is None:
            responses.append(self._response(requests[0], results))
        else:
            offset = 0
            for r, n in zip(requests, sizes):
                part = {}
                for name, arr in results.items():
                    if arr.ndim == 0 or arr.shape[0] != sum(sizes):
                        raise InvalidArgument(
                            f"model '{self.ctx.name}' output '{name}' has shape {list(arr.shape)}, which "
                            f"does not have the batch size {sum(sizes)} along its first dimension"
                        )
                    part[name] = arr[offset : offset + n]
                offset += n
                responses.append(self._response(r, part))
        timing.input_ns += t1 - t0
        timing.infer_ns += t2 - t1
        timing.output_ns += time.monotonic_ns() - t2
        return responses

    def _wanted_outputs(self, requests) -> list[str]:
        names: list[str] = []
        for r in requests:
            if not r.outputs:
                return self.all_outputs
            for o in r.outputs:
                if o.name not in names:
                    names.append(o.name)
        return names

    def _response(self, request: InferenceRequest, results: dict[str, np.ndarray]) -> InferenceResponse:
        if request.outputs:
            names = [o.name for o in request.outputs]
        else:
            names = self.all_outputs
        outputs = []
        for name in names:
            arr = results[name]
            outputs.append(OutputTensor(name, datatype_of(arr, self.output_types.get(name)), arr))
        return InferenceResponse(
            model_name=self.ctx.name, model_version=str(self.ctx.version), outputs=outputs, id=request.id
        )
