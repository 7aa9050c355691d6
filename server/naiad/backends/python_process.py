"""Process-isolated python model instances: each instance runs `model.py` in its own worker process.

Why: in-process python instances (`PythonInstance`) share the server's GIL, so `instance_group
{ count: 2 kind: KIND_CPU }` on a CPU-bound python model gives no speed-up. Triton runs every python
instance in a stub process; `ProcessInstance` does the same, paying one process hop per execution.

Choice (`execution_isolation`): the model parameter `EXECUTION_ISOLATION` ("process" or "thread")
forces the mode. Otherwise a model with more than one instance (over all instance groups) runs in
process mode and a model with a single instance runs in-process, because of these figures
(`bench/python_instances.py`, in-process Server API, concurrency 8, 2-core machine shared with other
work, requests/s, median of 3 runs of 3 s):

    model                       count=1 thread   count=2 thread   count=2 process
    cpu_burn (200k iterations)       {burn_1t}            {burn_2t}            {burn_2p}
    identity (16 FP32)             {id_1t}          {id_2t}          {id_2p}

A CPU-bound model gains ~{burn_gain}x from two processes, while threads give nothing; a trivial model
loses about {id_loss}% to the hop. A user asks for several instances to run several executions at once,
which only processes deliver for python code; a single instance gains nothing from a process and
would only pay the hop, so it stays in-process.

Wire protocol: one `socket.socketpair()` per instance. A frame is a header (`<QI`: pickle length,
buffer count), the out-of-band buffer lengths (`<Q` each), the pickle (protocol 5), then the raw
buffers, sent with one `sendmsg` (scatter/gather, no user-space copy) and received with `readinto`
into writable `bytearray`s that the unpickled numpy arrays use directly: a tensor crosses the
socket once and is copied by the kernel only. Messages are tuples:

    parent -> worker
        ("execute", call, [request fields], [stream key | None])   run a batch
        ("finalize", call)                                          call finalize and exit
        ("bls_reply", bls, response | None, error | None)           result (or end of stream) of a BLS call
        ("bls_stream", bls, response)                               one response of a decoupled BLS call
        ("cancel", key)                                             a decoupled request was cancelled
    worker -> parent
        ("reply", call, value, error)          startup (call 0: pid), execute ((responses, t0, t1)), finalize
        ("response", key, response)            a decoupled response, from any model thread, at any time
        ("bls", bls, request fields, decoupled) a BLS request; the parent runs it on the server loop
        ("log", logger name, level, message)   a log record of the model

A reader thread on each side dispatches messages as they arrive, so BLS calls are served while an
execution is in flight and decoupled responses flow after `execute` returned. A worker that dies
fails the in-flight execution, ends open decoupled streams with an error, and makes the instance
answer every later request with the same error (Triton would restart the stub; Naiad does not).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import multiprocessing.util  # noqa: F401 - imported before our atexit hook so that ours runs first
import os
import pickle
import signal
import socket
import struct
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from ..config import ModelConfig
from ..errors import Internal, InvalidArgument, NaiadError, Unavailable, as_naiad_error
from ..inference import InferenceRequest, InferenceResponse
from .base import ModelContext, ModelInstance, Timing

log = logging.getLogger("naiad.python")

ISOLATION_PARAMETER = "EXECUTION_ISOLATION"
ISOLATION_MODES = ("process", "thread")
STARTUP_CALL = 0  # the call id of the worker's first reply: its pid, or why initialize failed


def instance_count(config: ModelConfig) -> int:
    """How many instances the repository creates for `config` (one per count per listed GPU)."""
    total = 0
    for group in config.instance_group:
        devices = len(group.gpus) if group.kind == mc.ModelInstanceGroup.KIND_GPU and group.gpus else 1
        total += group.count * devices
    return total


def execution_isolation(config: ModelConfig) -> str:
    """"process" or "thread" for a python model: the EXECUTION_ISOLATION parameter, else by instance count."""
    if ISOLATION_PARAMETER in config.parameters:
        value = config.parameters[ISOLATION_PARAMETER].string_value.strip().lower()
        if value not in ISOLATION_MODES:
            raise InvalidArgument(f"model '{config.name}': parameter {ISOLATION_PARAMETER} must be "
                                  f"'process' or 'thread', got '{value}'")
        return value
    return "process" if instance_count(config) > 1 else "thread"


# ---- wire protocol, used by both sides ----

_HEADER = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")
_MAX_PARTS = 512  # stay well below IOV_MAX per sendmsg
PICKLE_ERRORS = (pickle.PicklingError, TypeError, AttributeError)  # what pickle.dumps raises for odd objects


class Channel:
    """Framed pickle-5 messages over a connected stream socket; `send` from any thread, `recv` from one."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._rfile = sock.makefile("rb", buffering=1 << 16)
        self._send_lock = threading.Lock()

    def send(self, message: tuple) -> None:
        """Pickle first (a pickling error leaves the stream intact), then write the frame atomically."""
        buffers: list[pickle.PickleBuffer] = []
        payload = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        head = _HEADER.pack(len(payload), len(raws)) + b"".join(_LENGTH.pack(r.nbytes) for r in raws)
        parts = [memoryview(head), memoryview(payload), *raws]
        with self._send_lock:
            _sendmsg_all(self.sock, parts)

    def recv(self) -> Any:
        """The next message; EOFError when the peer closed the socket."""
        head = self._read_exact(_HEADER.size)
        size, count = _HEADER.unpack(head)
        lengths = [_LENGTH.unpack(self._read_exact(_LENGTH.size))[0] for _ in range(count)]
        payload = self._read_exact(size)
        buffers = []
        for n in lengths:
            buf = bytearray(n)
            self._read_into(memoryview(buf))
            buffers.append(buf)
        return pickle.loads(payload, buffers=buffers)

    def _read_exact(self, n: int) -> bytes:
        data = self._rfile.read(n)
        if len(data) != n:
            raise EOFError("peer closed the channel")
        return data

    def _read_into(self, view: memoryview) -> None:
        while view.nbytes:
            got = self._rfile.readinto(view)
            if not got:
                raise EOFError("peer closed the channel")
            view = view[got:]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._rfile.close()
        self.sock.close()


def _sendmsg_all(sock: socket.socket, parts: list[memoryview]) -> None:
    views = [p.cast("B") if p.format != "B" or p.ndim != 1 else p for p in parts if p.nbytes]
    while views:
        sent = sock.sendmsg(views[:_MAX_PARTS])
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


_REQUEST_FIELDS = ("model_name", "inputs", "datatypes", "model_version", "id", "outputs", "parameters",
                   "priority", "timeout_us", "correlation_id", "flags")


def request_fields(request: InferenceRequest) -> dict:
    """What of a request crosses the process boundary (not its callback or arrival time)."""
    return {f: getattr(request, f) for f in _REQUEST_FIELDS}


def request_from_fields(fields: dict, callback=None) -> InferenceRequest:
    return InferenceRequest(**fields, response_callback=callback)


def transferable_error(exc: BaseException) -> NaiadError:
    """An error that pickles and keeps the text the model saw: NaiadErrors as they are, others as Internal."""
    return exc if isinstance(exc, NaiadError) else Internal(str(exc))


# ---- the parent side ----

_live: "weakref.WeakSet[ProcessInstance]" = weakref.WeakSet()


@atexit.register
def _close_channels_at_exit() -> None:
    """Workers are non-daemonic (models may start processes); closing their sockets makes them exit, so
    multiprocessing's own exit hook, which joins them, does not wait forever."""
    for inst in list(_live):
        if inst._channel is not None:
            inst._channel.close()


class ProcessInstance(ModelInstance):
    """A python model instance whose `TritonPythonModel` lives in a worker process (see module docstring)."""

    def __init__(self, ctx: ModelContext, group, device_id: int, index: int):
        super().__init__(ctx, group, device_id, index)
        self.decoupled = ctx.config.model_transaction_policy.decoupled
        self.pid: int | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._channel: Channel | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._calls = itertools.count(1)
        self._keys = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._call_keys: dict[int, list[int]] = {}
        self._streams: dict[int, InferenceRequest] = {}
        self._cancel_sent: set[int] = set()
        self._dead: NaiadError | None = None
        self._exit_expected = False  # set on unload, and when initialize failed

    # ---- lifecycle ----
    def warmup_thread_init(self) -> None:
        """Start the worker (on the instance thread, so instances start in parallel) and wait for initialize."""
        if self._process is not None:
            return
        from . import python_worker
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spec = {
            "name": self.ctx.name,
            "version": self.ctx.version,
            "config": self.ctx.config.SerializeToString(),
            "model_dir": str(self.ctx.model_dir),
            "version_dir": str(self.ctx.version_dir),
            "group": self.group.SerializeToString(),
            "device_id": self.device_id,
            "index": self.index,
            "log_level": logging.getLogger().getEffectiveLevel(),
        }
        started: Future = Future()
        self._pending[STARTUP_CALL] = started
        context = multiprocessing.get_context("spawn")
        self._process = context.Process(target=python_worker.main, args=(child_sock, spec),
                                        name=f"naiad-python-{self.ctx.name}-{self.name}")
        try:
            self._process.start()
        finally:
            child_sock.close()
        self._channel = Channel(parent_sock)
        _live.add(self)
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"naiad-{self.ctx.name}-{self.name}-reader")
        self._reader.start()
        self.pid = started.result()

    def close(self) -> None:
        """Call `finalize` in the worker and reap it; a finalize error is raised, as PythonInstance does."""
        if self._process is None:
            return
        try:
            self._exit_expected = True
            try:
                call, future = self._register({})
                self._send(("finalize", call))
                future.result()
            except NaiadError as exc:
                if exc is not self._dead:  # the worker being gone already is not an error at unload
                    raise
        finally:
            self._reap()

    def _reap(self) -> None:
        self._process.join(10)
        if self._process.is_alive():
            log.warning("python worker of model '%s' instance '%s' did not exit after finalize; killing it",
                        self.ctx.name, self.name)
            self._process.kill()
            self._process.join(5)
        if self._channel is not None:
            self._channel.close()
        if self._reader is not None:
            self._reader.join(5)
        _live.discard(self)

    # ---- execution ----
    def execute(self, requests: list[InferenceRequest], timing: Timing) -> list[InferenceResponse | None]:
        t0 = time.monotonic_ns()
        keys: list[int | None] = [
            next(self._keys) if self.decoupled and r.response_callback is not None else None for r in requests
        ]
        call, future = self._register({k: r for k, r in zip(keys, requests) if k is not None})
        try:
            self._send(("execute", call, [request_fields(r) for r in requests], keys))
            responses, started_ns, done_ns = future.result()
        except BaseException:
            with self._lock:
                self._pending.pop(call, None)
                for key in self._call_keys.pop(call, []):
                    self._streams.pop(key, None)
            raise
        with self._lock:
            self._call_keys.pop(call, None)
        end = time.monotonic_ns()
        # CLOCK_MONOTONIC is system-wide: the worker's stamps split the round trip as Triton's stats do.
        timing.input_ns += max(0, started_ns - t0)
        timing.infer_ns += max(0, done_ns - started_ns)
        timing.output_ns += max(0, end - done_ns)
        return responses

    def _register(self, streams: dict[int, InferenceRequest]) -> tuple[int, Future]:
        """A call id and the future of its reply; raises at once if the worker is gone (nothing waits forever).

        `streams` are the call's decoupled requests by key: their responses may arrive before the reply."""
        future: Future = Future()
        with self._lock:
            if self._dead is not None:
                raise self._dead
            call = next(self._calls)
            self._pending[call] = future
            if streams:
                self._call_keys[call] = list(streams)
                self._streams.update(streams)
        return call, future

    def _send(self, message: tuple) -> None:
        try:
            self._channel.send(message)
        except PICKLE_ERRORS as exc:
            raise Internal(f"model '{self.ctx.name}': cannot send a message to the python worker of "
                           f"instance '{self.name}': {exc}") from None
        except OSError:
            self._reader.join(5)  # the reader records why the worker went away
            raise self._dead or Internal(f"model '{self.ctx.name}': the python worker of instance "
                                         f"'{self.name}' is not reachable") from None

    def _send_quietly(self, message: tuple) -> None:
        """Send from the server loop (BLS results); a worker that has gone away no longer needs them."""
        try:
            self._channel.send(message)
        except OSError:
            pass
        except PICKLE_ERRORS as exc:  # e.g. a BLS response with objects that do not pickle
            if message[0] == "bls_reply":
                self._send_quietly(("bls_reply", message[1], None, Internal(f"cannot send the BLS response "
                                                                             f"to the python worker: {exc}")))

    # ---- the reader thread ----
    def _read_loop(self) -> None:
        reason = None
        try:
            while True:
                self._dispatch(self._channel.recv())
        except (EOFError, OSError):
            pass
        except Exception as exc:  # noqa: BLE001 - an undecodable message ends the worker: nothing may hang
            reason = f"undecodable message from the worker: {type(exc).__name__}: {exc}"
            self._process.kill()
        self._on_worker_exit(reason)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "reply":
            _, call, value, error = message
            with self._lock:
                future = self._pending.pop(call, None)
            if call == STARTUP_CALL and error is not None:
                self._exit_expected = True
            if future is not None:
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(value)
        elif kind == "response":
            self._deliver(message[1], message[2])
        elif kind == "bls":
            self._start_bls(*message[1:])
        elif kind == "log":
            _, name, level, text = message
            logger = logging.getLogger(name)
            if logger.isEnabledFor(level):
                logger.handle(logging.makeLogRecord({"name": name, "levelno": level, "msg": text, "args": None,
                                                     "levelname": logging.getLevelName(level)}))

    def _deliver(self, key: int, response: InferenceResponse) -> None:
        """A decoupled response: hand it to the request's callback; tell the worker once it is cancelled."""
        with self._lock:
            native = self._streams.get(key)
            if native is not None and response.final:
                del self._streams[key]
                self._cancel_sent.discard(key)
        if native is None:
            log.warning("model '%s' sent a response for a request that is complete", self.ctx.name)
            return
        try:
            native.response_callback(response)
        except Exception:  # noqa: BLE001 - a frontend's callback must not stop the reader
            log.exception("delivering a response of model '%s' failed", self.ctx.name)
        if native.cancelled and not response.final:
            with self._lock:
                first = key not in self._cancel_sent
                self._cancel_sent.add(key)
            if first:
                self._send_quietly(("cancel", key))

    def _start_bls(self, bls: int, fields: dict, decoupled: bool) -> None:
        """Run a BLS request of the worker on the server loop; the result goes back as messages."""
        server, loop = self.ctx.server, self.ctx.loop
        if server is None or loop is None:
            self._send_quietly(("bls_reply", bls, None, Internal("BLS requests need a running Naiad server")))
            return
        native = request_from_fields(fields)
        if decoupled:
            native.response_callback = lambda resp: self._send_quietly(("bls_stream", bls, resp))

            async def run_stream() -> None:
                async for _ in server.infer_stream(native):
                    pass

            future = asyncio.run_coroutine_threadsafe(run_stream(), loop)
        else:
            future = asyncio.run_coroutine_threadsafe(server.infer(native), loop)

        def done(f) -> None:
            try:
                result = f.result()
            except BaseException as exc:  # noqa: BLE001 - BLS errors go back to the model
                self._send_quietly(("bls_reply", bls, None, transferable_error(exc)))
                return
            self._send_quietly(("bls_reply", bls, None if decoupled else result, None))

        future.add_done_callback(done)

    def _on_worker_exit(self, reason: str | None) -> None:
        """Fail whatever waits on the worker; later requests get the same error."""
        if self._exit_expected and reason is None:
            error: NaiadError = Unavailable(f"model '{self.ctx.name}' instance '{self.name}' was unloaded")
        else:
            self._process.join(2)
            code = self._process.exitcode
            if reason is None:
                reason = f"exit code {code}"
                if code is not None and code < 0:
                    try:
                        reason = f"killed by {signal.Signals(-code).name}"
                    except ValueError:
                        pass
            error = Internal(f"Failed to process the request(s) for model '{self.name}', message: the python "
                             f"worker process (pid {self._process.pid}) of model '{self.ctx.name}' exited "
                             f"unexpectedly ({reason}); reload the model to restart it")
            log.error("%s", error)
        with self._lock:
            self._dead = error
            pending, self._pending = self._pending, {}
            in_flight = {k for keys in self._call_keys.values() for k in keys}
            streams = [(k, r) for k, r in self._streams.items() if k not in in_flight]
            for k, _ in streams:
                del self._streams[k]
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
        for _, native in streams:
            try:
                native.response_callback(InferenceResponse(
                    model_name=native.model_name, model_version=str(native.model_version), id=native.id,
                    error=error, final=True))
            except Exception:  # noqa: BLE001
                log.exception("ending a stream of model '%s' failed", self.ctx.name)
