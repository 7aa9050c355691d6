"""The engine side of `--frontend-workers`: serves the workers' connections on a Unix socket, running each
forwarded request, stream and control call on the one in-process `Server`."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from typing import Any

from tritonclient.grpc import service_pb2 as pb

from ..frontends.transport import eager
from ..host_pinning import HostPinning
from ..inference import OutputTensor
from ..server import Server
from ..shared_memory.system import SharedMemoryManager
from . import leftovers, model_context, wire
from .channel import Channel
from .slabs import SHM_DIR, SlabMaps, SlabPool

log = logging.getLogger("naiad.engine")


class EngineService:
    """Listens for frontend workers; each gets a `WorkerConnection` (data) and a control connection."""

    def __init__(self, server: Server, shm: SharedMemoryManager, pinning: HostPinning | None = None):
        self.server = server
        self.shm = shm
        self.shm_generation = 0  # bumped on every (un)registration, so workers drop stale mappings
        self._sweep()
        self.pool = SlabPool(f"naiad-e{os.getpid()}")
        self.pool.on_drop = self._unlinked
        self.maps = SlabMaps(pinning)  # the workers' segments, page-locked on a GPU server
        self._dir = tempfile.mkdtemp(prefix=leftovers.SOCKET_DIR_PREFIX)
        # held while this engine lives: other engines' sweeps leave the directory
        self._dir_lock = leftovers.hold(self._dir, directory=True)
        self.path = os.path.join(self._dir, leftovers.SOCKET_NAME)
        self._listener: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.connections: set[WorkerConnection] = set()

    @staticmethod
    def _sweep() -> None:
        """Remove what engines and workers killed before they could clean up left (leftovers.py)."""
        try:
            segments = leftovers.sweep_segments(SHM_DIR)
            dirs = leftovers.sweep_socket_dirs(tempfile.gettempdir())
        except OSError as exc:
            log.warning("could not look for what earlier engines left: %s", exc)
            return
        if segments or dirs:
            log.info(
                "removed what engines and workers that are gone left: %d shared-memory segment(s), %d socket "
                "directory(ies)",
                len(segments),
                len(dirs),
            )

    def _unlinked(self, slab: str) -> None:
        """The engine's pool unlinked a slab of outputs (any thread): every worker unmaps it."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._unmap_everywhere, slab)

    def _unmap_everywhere(self, slab: str) -> None:
        for conn in self.connections:
            conn.channel.send(wire.Unmap([slab]))

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._listener = await loop.create_unix_server(lambda: WorkerConnection(self).channel, self.path)

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for conn in list(self.connections):
            conn.channel.close()
        self.pool.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._dir_lock >= 0:
            os.close(self._dir_lock)
            self._dir_lock = -1

    # ---- control calls: name -> (server, args) -> a msgpack-able value ----
    def call(self, method: str, args: list[Any]) -> Any:
        s = self.server
        if method == "live":
            return s.live()
        if method == "ready":
            return s.ready()
        if method == "metadata":
            return s.metadata()
        if method == "model_info":
            return _model_info(s.model(*args))
        if method == "model_context":
            return model_context.describe(s.model(*args))
        if method == "model_names":
            return list(s.repository.records)
        if method == "model_versions":  # a record's loaded versions, as repository.records[name].versions
            rec = s.repository.records.get(args[0])
            return [_model_info(mv) for _, mv in sorted(rec.versions.items())] if rec is not None else []
        if method == "model_metadata":
            return s.model_metadata(*args)
        if method == "model_ready":
            return s.model_ready(*args)
        if method == "model_statistics":
            return s.model_statistics(*args)
        if method == "orchestrated":
            return s.orchestrated
        if method == "has_model":
            return args[0] in s.repository.records
        if method == "log_get":
            return s.log_settings.get()
        if method == "log_update":
            return s.log_settings.update(args[0])
        if method == "log_grpc":
            return s.log_settings.grpc(pb.LogSettingsRequest.FromString(args[0])).SerializeToString()
        if method == "trace_get":
            return s.tracer.get(*args)
        if method == "trace_update":
            return s.tracer.update(*args)
        if method == "trace_grpc":
            return s.tracer.grpc(pb.TraceSettingRequest.FromString(args[0])).SerializeToString()
        if method == "trace_active":
            return s.tracer.active
        if method == "shm_register":
            self.shm.register(*args)
            self.shm_generation += 1
            return None
        if method == "shm_unregister":
            self.shm.unregister(*args)
            self.shm_generation += 1
            return None
        if method == "shm_status":
            return self.shm.status(*args)
        if method == "shm_lookup":  # what a worker needs to use a region a request names
            return self._shm_lookup(args[0])
        if method.startswith("cuda_shm_"):
            return self._cuda_call(method, args)
        raise wire.raise_error("InvalidArgument", f"unknown engine call '{method}'")

    def _shm_lookup(self, name: str) -> list:
        """["system", key, offset, byte_size] or ["cuda"]; InvalidArgument (as a single process says it) when
        no region has that name."""
        cuda = getattr(self.shm, "cuda", None)
        if cuda is not None and cuda.has(name):
            return ["cuda"]
        r = self.shm._region(name)
        return ["system", r.key, r.offset, r.byte_size]

    def _cuda_call(self, method: str, args: list[Any]) -> Any:
        """CUDA shared memory, when this server serves it (it has a GPU): the workers forward registrations
        here, where the IPC mappings are opened once for every worker."""
        cuda = getattr(self.shm, "cuda", None)
        if method == "cuda_shm_state":  # None: the frontends answer as a server without a GPU
            return None if cuda is None else [cuda.enabled, cuda.reason]
        if cuda is None:
            raise wire.raise_error("InvalidArgument", "CUDA shared memory is not supported by this server")
        if method == "cuda_shm_register":
            cuda.register(*args)
        elif method == "cuda_shm_unregister":
            cuda.unregister(*args)
        elif method == "cuda_shm_status":
            return cuda.status(*args)
        else:
            raise wire.raise_error("InvalidArgument", f"unknown engine call '{method}'")
        self.shm_generation += 1
        return None

    def cuda_outputs(self, request) -> dict[str, dict]:
        """The requested outputs that go to CUDA shared memory regions: name -> their parameters."""
        cuda = getattr(self.shm, "cuda", None)
        if cuda is None:
            return {}
        return {
            o.name: o.parameters
            for o in request.outputs
            if o.parameters and cuda.has(o.parameters.get("shared_memory_region"))
        }

    async def call_async(self, method: str, args: list[Any]) -> Any:
        s = self.server
        if method == "index":
            await s.repository.refresh()
            return s.repository.index(*args)
        if method == "load_model":
            await s.load_model(*args)
            return None
        if method == "unload_model":
            await s.unload_model(*args)
            return None
        if method == "ready_model":  # with --load-on-demand, the engine loads the model first
            mv, waited = await s.ready_model(*args)
            return [*_model_info(mv), waited]
        if method == "tokenize":  # name, version, text, add_special
            return await model_context.tokenize(s.model(args[0], args[1]), *args[2:])
        if method == "detokenize":  # name, version, ids
            return await model_context.detokenize(s.model(args[0], args[1]), args[2])
        if method == "check_structured_outputs":  # name, version, spec
            return await model_context.check_structured_outputs(s.model(args[0], args[1]), args[2])
        if method == "change_lora":  # name, version, adapter, path (None: unload)
            return await model_context.change_lora(s.model(args[0], args[1]), args[2], args[3])
        return self.call(method, args)


def _model_info(mv) -> list:
    """What a worker's RemoteModel is made of: name, version, config, and the load it is."""
    return [mv.name, mv.version, mv.config.SerializeToString(), model_context.load_stamp(mv)]


_ASYNC_CALLS = frozenset(
    {
        "index",
        "load_model",
        "unload_model",
        "ready_model",
        "tokenize",
        "detokenize",
        "check_structured_outputs",
        "change_lora",
    }
)


class WorkerConnection:
    """One worker's connection: requests and streams run as tasks, replies go back in the order they finish."""

    def __init__(self, engine: EngineService):
        self.engine = engine
        self.channel = Channel(self.on_message, self.on_lost)
        self.pid = 0
        self.prefix = ""
        self.tasks: dict[int, asyncio.Task] = {}
        engine.connections.add(self)

    def _release(self, slab: str) -> None:
        """A request's input views are all gone: the worker may reuse its slab (any thread)."""
        try:
            self.channel.send_threadsafe(wire.Free([slab]))
        except RuntimeError:  # the loop is closed: the process is exiting
            pass

    def on_message(self, msg: wire.Message) -> None:
        loop = self.channel.loop
        if isinstance(msg, wire.Infer):
            self._start(msg.id, self._infer(msg.id, msg.request))
        elif isinstance(msg, wire.Stream):
            self.tasks[msg.id] = loop.create_task(self._stream(msg.id, msg.request))
        elif isinstance(msg, wire.Free):
            for name in msg.slabs:
                self.engine.pool.free(name)
        elif isinstance(msg, wire.Unmap):
            self.engine.maps.unmap(msg.slabs)
        elif isinstance(msg, wire.Call):
            if msg.method in _ASYNC_CALLS:
                self.tasks[msg.id] = loop.create_task(self._call_async(msg.id, msg.method, msg.args))
            else:
                try:
                    value = self.engine.call(msg.method, msg.args)
                except Exception as exc:
                    self.channel.send(wire.Error(msg.id, *wire.error_of(exc)))
                else:
                    self.channel.send(wire.Value(msg.id, value))
        elif isinstance(msg, wire.Cancel):
            task = self.tasks.pop(msg.id, None)
            if task is not None:
                task.cancel()
        elif isinstance(msg, wire.Hello):
            self.pid, self.prefix = msg.pid, msg.prefix

    def _start(self, rid: int, coro) -> None:
        """Run a request at once; a Task drives it on only if its model makes it wait (frontends/transport/eager.py)."""
        task = eager.start_now(self.channel.loop, coro)
        if task is not None:
            self.tasks[rid] = task

    def on_lost(self) -> None:
        self.engine.connections.discard(self)
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()
        if self.prefix:
            self.engine.maps.forget(self.prefix)

    def _reply(self, rid: int, resp, peer, cuda_outputs: dict[str, dict], load_wait_ns: int = 0) -> None:
        e = self.engine
        if cuda_outputs:  # written here, where the regions are mapped; the worker gets their spans
            outputs = []
            for out in resp.outputs:  # (new tensors: the response cache may hold these ones)
                params = cuda_outputs.get(out.name)
                if params is not None:
                    e.shm.cuda.write_output(out, params)  # type: ignore[attr-defined]
                    span = wire.CudaSpan(out.datatype, list(out.data.shape), params)
                    out = OutputTensor(out.name, out.datatype, span)  # type: ignore[arg-type]
                outputs.append(out)
            resp.outputs = outputs
        reply = wire.encode_response(resp, e.pool, peer)
        if load_wait_ns:
            reply.load_wait_ns = load_wait_ns
        self.channel.send(wire.Reply(rid, reply, e.server.tracer.active, e.shm_generation))

    async def _infer(self, rid: int, msg: wire.Request) -> None:
        try:
            req = wire.decode_request(msg, self.engine.maps, self._release, self.engine.shm)
            peer = self.engine.maps.view(msg.slab) if msg.slab else None  # outputs that are inputs stay there
            del msg
            cuda_outputs = self.engine.cuda_outputs(req)
            resp = await self.engine.server.infer(req)
            waited = req.load_wait_ns
            del req
            self._reply(rid, resp, peer, cuda_outputs, waited)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.channel.send(wire.Error(rid, *wire.error_of(exc)))
        finally:
            self.tasks.pop(rid, None)

    async def _stream(self, rid: int, msg: wire.Request) -> None:
        try:
            req = wire.decode_request(msg, self.engine.maps, self._release, self.engine.shm)
            peer = self.engine.maps.view(msg.slab) if msg.slab else None
            del msg
            cuda_outputs = self.engine.cuda_outputs(req)
            async for resp in self.engine.server.infer_stream(req):
                self._reply(rid, resp, peer, cuda_outputs)
                if resp.final:
                    return
            self.channel.send(wire.Value(rid, None))  # the stream ended without a final response
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.channel.send(wire.Error(rid, *wire.error_of(exc)))
        finally:
            self.tasks.pop(rid, None)

    async def _call_async(self, rid: int, method: str, args: list[Any]) -> None:
        try:
            value = await self.engine.call_async(method, args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.channel.send(wire.Error(rid, *wire.error_of(exc)))
        else:
            self.channel.send(wire.Value(rid, value))
        finally:
            self.tasks.pop(rid, None)
