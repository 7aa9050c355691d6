"""What a frontend worker may ask of the engine besides inference: health, metadata, models, statistics, model
control, the repository index, log and trace settings, shared-memory registrations, the OpenAI frontend's tokenizer.
Each call is a method of `EngineCalls`, named on the wire (`wire.Call.method`) by the method's name; `@call`
collects them into `CALLS` (name -> the function, and whether it is a coroutine function), where the engine looks a
call up (`core.WorkerConnection`). A worker names a call by the method itself (`control.call(EngineCalls.live)`,
engine/client.py), so a misspelt one is an error mypy reports, and tests/test_engine_calls.py holds every call a
worker makes to this table. The values go back as msgpack: lists, dicts, strings, bytes, numbers, None."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from tritonclient.grpc import service_pb2 as pb

from ..shared_memory.system import SharedMemoryManager
from . import model_context, wire

if TYPE_CHECKING:
    from ..server import Server
    from ..shared_memory.cuda import CudaSharedMemoryManager


class Call(NamedTuple):
    fn: Callable[..., Any]  # an EngineCalls method: fn(engine, *args)
    is_async: bool  # a coroutine function: the engine runs it in a task of its own


CALLS: dict[str, Call] = {}

F = TypeVar("F", bound=Callable[..., Any])


def call(fn: F) -> F:
    """Make the method `fn` a call workers may make, by its name."""
    CALLS[fn.__name__] = Call(fn, inspect.iscoroutinefunction(fn))
    return fn


def model_info(mv: Any) -> list:
    """What a worker's RemoteModel is made of: name, version, config, and the load it is."""
    return [mv.name, mv.version, mv.config.SerializeToString(), model_context.load_stamp(mv)]


class EngineCalls:
    """The calls, answered from the engine's `server` and its shared-memory manager `shm`. `shm_generation` changes
    with every (un)registration (every reply carries it), so that workers drop the mappings they hold."""

    def __init__(self, server: Server, shm: SharedMemoryManager):
        self.server = server
        self.shm = shm
        self.shm_generation = 0

    # ---- health and metadata ----
    @call
    def live(self) -> bool:
        return self.server.live()

    @call
    def ready(self) -> bool:
        return self.server.ready()

    @call
    def metadata(self) -> dict:
        return self.server.metadata()

    @call
    def orchestrated(self) -> bool:
        return self.server.orchestrated

    # ---- models ----
    @call
    def model_info(self, name: str, version: int) -> list:
        return model_info(self.server.model(name, version))

    @call
    def model_context(self, name: str, version: int) -> dict:
        return model_context.describe(self.server.model(name, version))

    @call
    def model_names(self) -> list[str]:
        return list(self.server.repository.records)

    @call
    def has_model(self, name: str) -> bool:
        return name in self.server.repository.records

    @call
    def model_versions(self, name: str) -> list[list]:
        """A record's loaded versions, as repository.records[name].versions."""
        rec = self.server.repository.records.get(name)
        return [model_info(mv) for _, mv in sorted(rec.versions.items())] if rec is not None else []

    @call
    def model_metadata(self, name: str, version: str | int = "") -> dict:
        return self.server.model_metadata(name, version)

    @call
    def model_ready(self, name: str, version: str | int = "") -> bool:
        return self.server.model_ready(name, version)

    @call
    def model_statistics(self, name: str = "", version: str | int = "") -> list[dict]:
        return self.server.model_statistics(name, version)

    @call
    async def ready_model(self, name: str, version: str | int = "") -> list:
        """With --load-on-demand, the engine loads the model first: its model_info, and the ns it waited."""
        mv, waited = await self.server.ready_model(name, version)
        return [*model_info(mv), waited]

    @call
    async def tokenize(
        self, name: str, version: int, text: str, add_special: bool | None = None
    ) -> list[int]:
        return await model_context.tokenize(self.server.model(name, version), text, add_special)

    @call
    async def detokenize(self, name: str, version: int, ids: list[int]) -> str:
        return await model_context.detokenize(self.server.model(name, version), ids)

    @call
    async def change_lora(self, name: str, version: int, adapter: str, path: str | None) -> None:
        """Load (a path) or unload (None) a LoRA adapter of a model; its load stamp changes, so every worker reads
        the model's adapters again."""
        await model_context.change_lora(self.server.model(name, version), adapter, path)

    @call
    async def check_structured_outputs(self, name: str, version: int, spec: Any) -> None:
        return await model_context.check_structured_outputs(self.server.model(name, version), spec)

    # ---- the repository and model control ----
    @call
    async def index(self, ready_only: bool = False, memory: bool = False) -> list[dict]:
        await self.server.repository.refresh()
        return self.server.repository.index(ready_only, memory)

    @call
    async def load_model(
        self, name: str, config: str | dict | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        await self.server.load_model(name, config, files)

    @call
    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self.server.unload_model(name, unload_dependents)

    # ---- logging and trace settings ----
    @call
    def log_get(self) -> dict:
        return self.server.log_settings.get()

    @call
    def log_update(self, changes: dict) -> dict:
        return self.server.log_settings.update(changes)

    @call
    def log_grpc(self, request: bytes) -> bytes:
        return self.server.log_settings.grpc(pb.LogSettingsRequest.FromString(request)).SerializeToString()

    @call
    def trace_get(self, model: str = "") -> dict:
        return self.server.tracer.get(model)

    @call
    def trace_update(self, changes: dict, model: str = "") -> dict:
        return self.server.tracer.update(changes, model)

    @call
    def trace_grpc(self, request: bytes) -> bytes:
        return self.server.tracer.grpc(pb.TraceSettingRequest.FromString(request)).SerializeToString()

    @call
    def trace_active(self) -> bool:
        return self.server.tracer.active

    # ---- system shared memory ----
    @call
    def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.shm.register(name, key, offset, byte_size)
        self.shm_generation += 1

    @call
    def shm_unregister(self, name: str = "") -> None:
        self.shm.unregister(name)
        self.shm_generation += 1

    @call
    def shm_status(self, name: str = "") -> list[dict]:
        return self.shm.status(name)

    @call
    def shm_lookup(self, name: str) -> list:
        """What a worker needs to use a region a request names: ["system", key, offset, byte_size] or ["cuda"];
        InvalidArgument (as a single process says it) when no region has that name."""
        cuda = self.cuda()
        if cuda is not None and cuda.has(name):
            return ["cuda"]
        r = self.shm._region(name)
        return ["system", r.key, r.offset, r.byte_size]

    # ---- CUDA shared memory, when this server serves it (it has a GPU): the workers forward registrations here,
    # where the IPC mappings are opened once for every worker ----
    def cuda(self) -> CudaSharedMemoryManager | None:
        """The CUDA shared-memory manager of a server with a GPU (`SharedMemoryManagerWithCuda.cuda`)."""
        return getattr(self.shm, "cuda", None)

    def _served_cuda(self) -> CudaSharedMemoryManager:
        cuda = self.cuda()
        if cuda is None:
            raise wire.raise_error("InvalidArgument", "CUDA shared memory is not supported by this server")
        return cuda

    @call
    def cuda_shm_state(self) -> list | None:
        """[enabled, reason] of the engine's manager; None: the frontends answer as a server without a GPU."""
        cuda = self.cuda()
        return None if cuda is None else [cuda.enabled, cuda.reason]

    @call
    def cuda_shm_register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self._served_cuda().register(name, raw_handle, device_id, byte_size)
        self.shm_generation += 1

    @call
    def cuda_shm_unregister(self, name: str = "") -> None:
        self._served_cuda().unregister(name)
        self.shm_generation += 1

    @call
    def cuda_shm_status(self, name: str = "") -> list[dict]:
        return self._served_cuda().status(name)
