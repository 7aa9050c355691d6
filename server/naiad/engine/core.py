"""The engine side of `--frontend-workers`: serves the workers' connections on a Unix socket, running each
forwarded request and stream on the one in-process `Server`, and each call by its name in `calls.CALLS`."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from ..frontends.transport import eager
from ..host_pinning import HostPinning
from ..inference import InferenceRequest
from ..server import Server
from ..shared_memory.system import SharedMemoryManager
from . import leftovers, wire
from .calls import CALLS, EngineCalls
from .channel import Channel
from .slabs import SHM_DIR, SlabMaps, SlabPool

log = logging.getLogger("naiad.engine")


class EngineService(EngineCalls):
    """Listens for frontend workers; each gets a `WorkerConnection` (data) and a control connection. The calls they
    make are its `EngineCalls` methods."""

    def __init__(self, server: Server, shm: SharedMemoryManager, pinning: HostPinning | None = None):
        super().__init__(server, shm)
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

    def cuda_outputs(self, request: InferenceRequest) -> dict[str, dict]:
        """The requested outputs that go to CUDA shared memory regions: name -> their parameters."""
        cuda = getattr(self.shm, "cuda", None)  # (per request: not through `self.cuda()`, a call more)
        if cuda is None:
            return {}
        return {
            o.name: o.parameters
            for o in request.outputs
            if o.parameters and cuda.has(o.parameters.get("shared_memory_region"))
        }


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
            call = CALLS.get(msg.method)
            if call is not None and call.is_async:
                self.tasks[msg.id] = loop.create_task(self._call_async(msg.id, call.fn, msg.args))
            else:
                try:
                    if call is None:
                        raise wire.raise_error("InvalidArgument", f"unknown engine call '{msg.method}'")
                    value = call.fn(self.engine, *msg.args)
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
            cuda = e.cuda()
            assert cuda is not None  # (only a server with CUDA shared memory finds such outputs)
            spans = {}
            for out in resp.outputs:
                params = cuda_outputs.get(out.name)
                if params is not None:
                    cuda.write_output(out, params)
                    spans[out.name] = wire.CudaSpan(out.datatype, list(out.data.shape), params)
            reply = wire.encode_response(resp, e.pool, peer, spans)
        else:
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

    async def _call_async(self, rid: int, fn: Callable[..., Awaitable[Any]], args: list[Any]) -> None:
        try:
            value = await fn(self.engine, *args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.channel.send(wire.Error(rid, *wire.error_of(exc)))
        else:
            self.channel.send(wire.Value(rid, value))
        finally:
            self.tasks.pop(rid, None)
