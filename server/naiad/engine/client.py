"""A frontend worker's server: the serving API the frontends call (`serving.Serving`), each call forwarded to the
engine process (inference and model control over the asynchronous data channel, the small synchronous queries over
a blocking control channel), with tensors in shared-memory slabs. `EngineClient` implements `Serving`, and
`RemoteRepository`, `RemoteRecords`, `RemoteModel`, `RemoteLogSettings` and `RemoteTracer` its views."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

from ..errors import Unavailable
from ..inference import InferenceRequest, InferenceResponse
from ..model import _specs
from ..server import parse_version
from . import wire
from .calls import EngineCalls
from .channel import Channel
from .model_context import RemoteContext, remote_context
from .remote_shm import RemoteSharedMemory
from .slabs import SlabMaps, SlabPool

if TYPE_CHECKING:
    from ..serving import Serving

CONTROL_TIMEOUT_S = 30.0


class ControlChannel:
    """Blocking request/answer calls for the frontends' synchronous queries (health, metadata, statistics,
    settings): one Unix-socket round trip while the worker's event loop waits (at most CONTROL_TIMEOUT_S; an
    answer that comes later is skipped by the next call)."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(CONTROL_TIMEOUT_S)
        self.sock.sendall(wire.frame(wire.Hello(os.getpid(), "", True)))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._buf = bytearray()

    def call(self, method: Callable[..., object], *args: Any) -> Any:
        """The engine's answer to `method` (an `EngineCalls` method) with `args`."""
        name = method.__name__
        with self._lock:
            rid = next(self._ids)
            try:
                self.sock.sendall(wire.frame(wire.Call(rid, name, list(args))))
                while True:
                    msg = wire.decoder.decode(self._read_frame())
                    if isinstance(msg, wire.Value | wire.Error) and msg.id == rid:
                        break
            except TimeoutError:
                raise Unavailable(f"the engine did not answer '{name}' in {CONTROL_TIMEOUT_S:g}s") from None
        if isinstance(msg, wire.Error):
            raise wire.exception(msg)
        assert isinstance(msg, wire.Value)
        return msg.value

    def _read_frame(self) -> bytes:
        """The next frame's body; what a timeout interrupts stays buffered for the next call."""
        buf = self._buf
        while True:
            if len(buf) >= 4:
                n = int.from_bytes(buf[:4], "little")
                if len(buf) >= 4 + n:
                    body = bytes(buf[4 : 4 + n])
                    del buf[: 4 + n]
                    return body
            chunk = self.sock.recv(65536)
            if not chunk:
                raise Unavailable("the engine process is gone")
            buf += chunk


class RemoteModel:
    """A served model (`serving.ServedModel`): what frontends read of the engine's `ModelVersion` (config, inputs,
    outputs, batching, decoupled, and the context the OpenAI frontend reads); `load` is the engine's load stamp."""

    def __init__(self, name: str, version: int, config: bytes, load: int, ctx: RemoteContext):
        self.name = name
        self.version = version
        self.load = load
        self.ctx = ctx
        self.config = mc.ModelConfig.FromString(config)
        self.inputs = _specs(self.config.input)
        self.outputs = _specs(self.config.output)
        self.max_batch_size = self.config.max_batch_size
        self.decoupled = self.config.model_transaction_policy.decoupled


class RemoteRecord:
    """`repository.records[name]` (`serving.ModelRecordView`): the model's loaded versions."""

    def __init__(self, name: str, versions: dict[int, RemoteModel]):
        self.name = name
        self.versions = versions


# what a READY index entry carries beyond Triton's keys when asked for memory (orchestration.measure)
_MEMORY_KEYS = frozenset(
    {"host_memory_bytes", "gpu_memory_bytes", "gpu_memory_bytes_by_device", "memory_source"}
)


class RemoteRepository:
    """The engine's model repository (`serving.RepositoryView`): `index` answers from the last `refresh`."""

    def __init__(self, client: EngineClient):
        self._client = client
        self.records = RemoteRecords(client)
        self._index: list[dict] = []

    def get(self, name: str, version: int = -1) -> RemoteModel:
        return self._client.model(name, version)

    async def refresh(self) -> None:
        self._index = await self._client.call(EngineCalls.index, False, True)

    def index(self, ready_only: bool = False, memory: bool = False) -> list[dict]:
        entries = [e for e in self._index if e.get("state") == "READY"] if ready_only else self._index
        if memory:
            return entries
        return [{k: v for k, v in e.items() if k not in _MEMORY_KEYS} for e in entries]


class RemoteRecords:
    """`repository.records` (`serving.RecordsView`): `name in records`, its names and `records[name].versions`,
    asked of the engine."""

    def __init__(self, client: EngineClient):
        self._client = client

    def __contains__(self, name: object) -> bool:
        return bool(self._client.control.call(EngineCalls.has_model, name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._client.control.call(EngineCalls.model_names))

    def __getitem__(self, name: str) -> RemoteRecord:
        client = self._client
        infos = client.control.call(EngineCalls.model_versions, name)
        if not infos and name not in self:
            raise KeyError(name)
        return RemoteRecord(name, {info[1]: client._remote_model(info) for info in infos})


class RemoteLogSettings:
    """The engine's log settings (`serving.LogSettingsView`)."""

    def __init__(self, client: EngineClient):
        self._control = client.control

    def get(self) -> dict:
        return self._control.call(EngineCalls.log_get)

    def update(self, changes: dict) -> dict:
        return self._control.call(EngineCalls.log_update, changes)

    def grpc(self, request: Any) -> Any:
        return pb.LogSettingsResponse.FromString(
            self._control.call(EngineCalls.log_grpc, request.SerializeToString())
        )

    def reopen(self) -> None:
        """The log file belongs to the engine; a worker logs to its stderr."""


class RemoteTracer:
    """The engine's trace settings (`serving.TracerView`); `active` is refreshed by every inference reply."""

    def __init__(self, client: EngineClient):
        self._control = client.control
        self.active = bool(self._control.call(EngineCalls.trace_active))

    def get(self, model: str = "") -> dict:
        return self._control.call(EngineCalls.trace_get, model)

    def update(self, changes: dict, model: str = "") -> dict:
        out = self._control.call(EngineCalls.trace_update, changes, model)
        self.active = bool(self._control.call(EngineCalls.trace_active))
        return out

    def grpc(self, request: Any) -> Any:
        out = pb.TraceSettingResponse.FromString(
            self._control.call(EngineCalls.trace_grpc, request.SerializeToString())
        )
        self.active = bool(self._control.call(EngineCalls.trace_active))
        return out


class EngineClient:
    """The serving API (`serving.Serving`) of a frontend worker's frontends, answered by the engine process."""

    name = "naiad"

    def __init__(self, path: str):
        self.path = path
        self.control = ControlChannel(path)
        self.pool = SlabPool(f"naiad-w{os.getpid()}")
        self.pool.on_drop = self._unlinked
        self.maps = SlabMaps()
        self.channel: Channel | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}
        self._request_slabs: dict[int, str] = {}  # a request's slab, where the engine may describe outputs
        self._models: dict[tuple[str, int], RemoteModel] = {}  # the last load seen of each model version
        self.repository = RemoteRepository(self)
        self.log_settings = RemoteLogSettings(self)
        self.tracer = RemoteTracer(self)
        self.shm: RemoteSharedMemory | None = None
        self.extensions = list(self.metadata()["extensions"])
        self.lost = asyncio.Event()

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, self.channel = await loop.create_unix_connection(
            lambda: Channel(self._on_message, self._on_lost), self.path
        )
        self.channel.send(wire.Hello(os.getpid(), self.pool.prefix, False))

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.pool.close()

    # ---- the data channel ----
    def _on_lost(self) -> None:
        gone = Unavailable("the engine process is gone")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(gone)
        for queue in self._streams.values():
            queue.put_nowait(gone)
        self.lost.set()

    def _on_message(self, msg: wire.Message) -> None:
        if type(msg) is wire.Reply:
            self.tracer.active = msg.tracing
            if self.shm is not None and msg.shm_generation != self.shm.generation:
                self.shm.generation = msg.shm_generation
                self.shm.drop()
            queue = self._streams.get(msg.id)
            fut = self._pending.pop(msg.id, None) if queue is None else None
            if queue is None and (fut is None or fut.done()):
                self._discard(msg.response, None)  # its caller gave up (a deadline, a client gone)
                return
            own = None
            for t in msg.response.outputs:
                if t.peer:
                    # outputs in this worker's own request slab: hold it now, before the engine's Free of it
                    # (read in this same call) could return it to the pool
                    name = self._request_slabs[msg.id]
                    own = (name, self.pool.retain(name), self.pool.free)
                    break
            if queue is not None:
                queue.put_nowait((msg.response, own))
            elif fut is not None:  # (it is: the reply returned above when neither waits)
                fut.set_result((msg.response, own))
        elif isinstance(msg, wire.Free):
            for name in msg.slabs:
                self.pool.free(name)
        elif isinstance(msg, wire.Unmap):
            self.maps.unmap(msg.slabs)
        elif isinstance(msg, (wire.Value, wire.Error)):
            queue = self._streams.get(msg.id)
            if queue is not None:
                queue.put_nowait(msg)
                return
            fut = self._pending.pop(msg.id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _discard(self, response: wire.Response, own: tuple | None) -> None:
        """A response nobody will read: the engine's slab of its outputs goes back to the engine now (a Free, as
        the last view of them would send), and `own`, this worker's request slab held for it, to this pool."""
        if response.slab and self.channel is not None and not self.channel.closed:
            self.channel.send(wire.Free([response.slab]))
        if own is not None:
            self.pool.free(own[0])

    def _unlinked(self, slab: str) -> None:
        """This worker's pool unlinked a slab or receive segment: the engine unmaps it too (any thread)."""
        self._send_threadsafe(wire.Unmap([slab]))

    def _release(self, slab: str) -> None:
        """A response's output views are all gone: the engine may reuse its slab (any thread)."""
        self._send_threadsafe(wire.Free([slab]))

    def _send_threadsafe(self, msg: wire.Message) -> None:
        if self.channel is not None:
            try:
                self.channel.send_threadsafe(msg)
            except RuntimeError:  # the loop is closed: the process is exiting
                pass

    def _send(self, msg: wire.Message) -> None:
        if self.channel is None or self.channel.closed:
            raise Unavailable("the engine process is gone")
        self.channel.send(msg)

    async def call(self, method: Callable[..., object], *args: Any) -> Any:
        """The engine's answer to `method` (an `EngineCalls` method) with `args`, over the data channel."""
        rid = next(self._ids)
        fut = self._pending[rid] = asyncio.get_running_loop().create_future()
        self._send(wire.Call(rid, method.__name__, list(args)))
        msg = await fut
        if isinstance(msg, wire.Error):
            raise wire.exception(msg)
        return msg.value

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        rid = next(self._ids)
        channel = self.channel
        # (the channel's loop, not asyncio's running one: on Python 3.11 asking costs a getpid system call)
        fut = self._pending[rid] = (
            channel.loop if channel is not None else asyncio.get_running_loop()
        ).create_future()
        try:
            desc = wire.encode_request(request, self.pool)
            if desc.slab:
                self._request_slabs[rid] = desc.slab
            self._send(wire.Infer(rid, desc))
            del desc
            msg = await fut
        except asyncio.CancelledError:
            # the client went away or its deadline passed: the engine drops the request too, so one still in a
            # queue is never executed (as in one process)
            if self.channel is not None and not self.channel.closed:
                self.channel.send(wire.Cancel(rid))
            raise
        finally:
            self._pending.pop(rid, None)
            self._request_slabs.pop(rid, None)
        if isinstance(msg, wire.Error):
            raise wire.exception(msg)
        if msg[0].load_wait_ns:  # the engine loaded the model on demand first: the frontend reports the wait
            request.load_wait_ns = msg[0].load_wait_ns
        return wire.decode_response(msg[0], self.maps, self._release, msg[1])

    async def infer_stream(self, request: InferenceRequest) -> AsyncGenerator[InferenceResponse, None]:
        rid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        done = False
        try:
            desc = wire.encode_request(request, self.pool)
            if desc.slab:
                self._request_slabs[rid] = desc.slab
            self._send(wire.Stream(rid, desc))
            del desc
            while True:
                msg = await queue.get()
                if isinstance(msg, Exception):
                    raise msg
                if isinstance(msg, wire.Error):
                    done = True
                    raise wire.exception(msg)
                if isinstance(msg, wire.Value):
                    done = True
                    return
                resp = wire.decode_response(msg[0], self.maps, self._release, msg[1])
                # the next one is here already: a writer may send both at once (as Server.infer_stream says)
                resp.more_ready = not queue.empty()
                if resp.final:
                    done = True
                if request.response_callback is not None:
                    request.response_callback(resp)
                yield resp
                if done:
                    return
        finally:
            self._streams.pop(rid, None)
            self._request_slabs.pop(rid, None)
            while not queue.empty():  # responses nobody will read: give back the slabs they hold
                left = queue.get_nowait()
                if type(left) is tuple:
                    self._discard(*left)
            if not done and self.channel is not None and not self.channel.closed:
                self.channel.send(wire.Cancel(rid))

    # ---- the synchronous queries ----
    def live(self) -> bool:
        return bool(self.control.call(EngineCalls.live))

    def ready(self) -> bool:
        return bool(self.control.call(EngineCalls.ready))

    def metadata(self) -> dict:
        return self.control.call(EngineCalls.metadata)

    def model(self, name: str, version: str | int = "") -> RemoteModel:
        return self._remote_model(self.control.call(EngineCalls.model_info, name, parse_version(version)))

    async def ready_model(self, name: str, version: str | int = "") -> tuple[RemoteModel, int]:
        """The model an inference request runs and the ns it waited (the engine loads it on demand)."""
        *info, waited = await self.call(EngineCalls.ready_model, name, version)
        mv = self._known(info)
        if mv is None:
            described = await self.call(EngineCalls.model_context, info[0], info[1])
            mv = self._remember(info, described)
        return mv, waited

    # ---- models, kept per engine load (their contexts cache what the OpenAI frontend works out per model) ----
    def _known(self, info: list) -> RemoteModel | None:
        """The model of `model_info`'s answer (name, version, config, load) when this load is known here."""
        mv = self._models.get((info[0], info[1]))
        return mv if mv is not None and mv.load == info[3] else None

    def _remember(self, info: list, described: dict) -> RemoteModel:
        name, version, config, load = info

        # the OpenAI frontend's token counts, by the engine's tokenizer
        async def tokenize(text: str, add_special: bool | None = None) -> list[int]:
            return await self.call(EngineCalls.tokenize, name, version, text, add_special)

        async def detokenize(ids: list[int]) -> str:
            return await self.call(EngineCalls.detokenize, name, version, ids)

        # the engine's check of a structured-output spec, which the OpenAI frontend runs on a thread (it may build a
        # grammar): asked over the data channel, so this worker's event loop goes on serving meanwhile
        def check_structured_outputs(spec: Any) -> None:
            channel = self.channel
            if (
                channel is None or asyncio._get_running_loop() is channel.loop
            ):  # on the loop: no thread to block
                self.control.call(EngineCalls.check_structured_outputs, name, version, spec)
            else:
                call = self.call(EngineCalls.check_structured_outputs, name, version, spec)
                asyncio.run_coroutine_threadsafe(call, channel.loop).result()

        # a LoRA adapter loaded (path) or unloaded (None) by the engine; the next model_info this worker asks for
        # carries a new load stamp, and with it the adapters the model lists now
        async def change_lora(lora: str, path: str | None) -> None:
            await self.call(EngineCalls.change_lora, name, version, lora, path)

        ctx = remote_context(
            name, version, described, tokenize, check_structured_outputs, detokenize, change_lora
        )
        mv = RemoteModel(name, version, config, load, ctx)
        self._models[(name, version)] = mv
        return mv

    def _remote_model(self, info: list) -> RemoteModel:
        mv = self._known(info)
        if mv is None:
            mv = self._remember(info, self.control.call(EngineCalls.model_context, info[0], info[1]))
        return mv

    @property
    def orchestrated(self) -> bool:
        """Whether the engine manages memory (the repository index then carries it)."""
        return bool(self.control.call(EngineCalls.orchestrated))

    def model_metadata(self, name: str, version: str | int = "") -> dict:
        return self.control.call(EngineCalls.model_metadata, name, version)

    def model_ready(self, name: str, version: str | int = "") -> bool:
        return bool(self.control.call(EngineCalls.model_ready, name, version))

    def model_statistics(self, name: str = "", version: str | int = "") -> list[dict]:
        return self.control.call(EngineCalls.model_statistics, name, version)

    async def load_model(
        self, name: str, config: str | dict | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        await self.call(EngineCalls.load_model, name, config, files)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self.call(EngineCalls.unload_model, name, unload_dependents)


if TYPE_CHECKING:

    def _serves(client: EngineClient) -> Serving:
        """(mypy) EngineClient implements the serving API the frontends call."""
        return client
