"""The worker process of a process-isolated python instance: its entry point `main` (the server side is `process`).

It hosts an ordinary `PythonInstance`, so importing `model.py`, `initialize` arguments, error texts and
response conversion are exactly those of in-process instances. What differs is only what lies outside
the process: `pb_utils` is bound to a `RemoteServer` whose BLS calls travel to the parent, decoupled
responses go to the parent as messages, and log records are forwarded to the server's logging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ...errors import Internal, as_naiad_error
from ...inference import InferenceRequest, InferenceResponse
from ..base import ModelContext, Timing
from .instance import PythonInstance
from .wire import (
    GROUP_SIGNALS,
    PICKLE_ERRORS,
    Channel,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)


class RemoteServer:
    """Stands in for `naiad.server.Server` in the worker: `pb_utils` BLS calls run in the parent.

    Its coroutines run on the worker's BLS loop (`pb_utils.InferenceRequest.exec` schedules them there);
    the reader thread settles them when the parent's answer arrives."""

    def __init__(self, channel: Channel):
        self._channel = channel
        self._ids = itertools.count(1)
        # bls id -> (its loop, the future of `infer` or the queue of `infer_stream`)
        self._calls: dict[
            int, tuple[asyncio.AbstractEventLoop, asyncio.Future | None, asyncio.Queue | None]
        ] = {}
        self._streams: dict[int, int] = {}  # id() of a request of `infer_stream` -> its bls id
        self._lock = threading.Lock()
        # server calls (model control, custom metrics): call id -> the future of its answer
        self._server_calls: dict[int, concurrent.futures.Future] = {}
        self.custom_metrics = RemoteMetrics(self)

    # ---- model control and custom metrics (`pb_utils.load_model`, `pb_utils.MetricFamily`, ...) ----
    def call(self, method: str, *args) -> concurrent.futures.Future:
        """Ask the server to run one of its `SERVER_CALLS`; the future settles with its answer."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            call = next(self._ids)
            self._server_calls[call] = future
        try:
            self._channel.send(("call", call, method, args))
        except BaseException:
            with self._lock:
                self._server_calls.pop(call, None)
            raise
        return future

    def call_reply(self, call: int, value, error) -> None:
        with self._lock:
            future = self._server_calls.pop(call, None)
        if future is None:
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    async def load_model(self, name: str, config, files) -> None:
        await asyncio.wrap_future(self.call("load_model", name, config, files))

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await asyncio.wrap_future(self.call("unload_model", name, unload_dependents))

    async def model_ready(self, name: str, version="") -> bool:
        return await asyncio.wrap_future(self.call("model_ready", name, version))

    def cancel_stream(self, request: InferenceRequest) -> None:
        """`ResponseIterator.cancel()` of a decoupled BLS request: the server marks its request cancelled."""
        with self._lock:
            bls = self._streams.get(id(request))
        if bls is not None:
            self._channel.send(("bls_cancel", bls))

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        bls = self._open(loop, future, None)
        try:
            self._channel.send(("bls", bls, encode_request(request), False))
            return await future
        finally:
            self._close(bls)

    async def infer_stream(self, request: InferenceRequest) -> AsyncIterator[InferenceResponse]:
        """As `Server.infer_stream`: the request's callback sees every response the parent's callback saw."""
        loop = asyncio.get_running_loop()
        responses: asyncio.Queue = asyncio.Queue()
        bls = self._open(loop, None, responses)
        with self._lock:
            self._streams[id(request)] = bls
        try:
            self._channel.send(("bls", bls, encode_request(request), True))
            if request.cancelled:
                self._channel.send(("bls_cancel", bls))
            while True:
                kind, value = await responses.get()
                if kind == "response":
                    if request.response_callback is not None:
                        request.response_callback(value)
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            with self._lock:
                self._streams.pop(id(request), None)
            self._close(bls)

    def _open(self, loop, future, responses) -> int:
        with self._lock:
            bls = next(self._ids)
            self._calls[bls] = (loop, future, responses)
        return bls

    def _close(self, bls: int) -> None:
        with self._lock:
            self._calls.pop(bls, None)

    def reply(self, bls: int, response: tuple | None, error: Exception | None) -> None:
        """The parent's answer (reader thread): the result of `infer`, or the end of `infer_stream`."""
        response = decode_response(response)
        with self._lock:
            entry = self._calls.get(bls)
        if entry is None:
            return
        loop, future, responses = entry
        if future is not None:
            loop.call_soon_threadsafe(_settle, future, response, error)
        else:
            loop.call_soon_threadsafe(responses.put_nowait, ("error", error) if error else ("end", None))

    def stream(self, bls: int, response: tuple) -> None:
        response = decode_response(response)
        with self._lock:
            entry = self._calls.get(bls)
        if entry is not None and entry[2] is not None:
            entry[0].call_soon_threadsafe(entry[2].put_nowait, ("response", response))


class RemoteMetrics:
    """`naiad.custom_metrics.CustomMetrics` of the server, seen from a worker: values live in the server, so that
    every instance of a model counts into the same metric. Updates are sent without waiting (pb_utils checked
    them already); creating metrics and reading values wait for the server's answer."""

    def __init__(self, server: RemoteServer):
        self._server = server

    def family(self, name: str, description: str, kind: int, owner=None) -> int:
        # the owner is this worker's instance, which the server knows: `owner` is only the in-process one's
        return self._server.call("metric_family", name, description, kind).result()

    def metric(self, family_id: int, labels, buckets, owner=None) -> int:
        return self._server.call("metric", family_id, labels, buckets).result()

    def update(self, metric_id: int, op: str, value) -> None:
        self._server._channel.send(("metric_update", metric_id, op, value))

    def value(self, metric_id: int) -> float:
        return self._server.call("metric_value", metric_id).result()


def _settle(future: asyncio.Future, response, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(response)


class _ForwardLogs(logging.Handler):
    """Sends the model's log records to the parent, which logs them with the server's handlers."""

    def __init__(self, channel: Channel):
        super().__init__()
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self._channel.send(("log", record.name, record.levelno, text))
        except Exception:
            self.handleError(record)


class Worker:
    """Runs one PythonInstance: the main thread serves the exec channel, a reader thread the side channel."""

    def __init__(self, exec_channel: Channel, side: Channel, spec: dict):
        self.exec = exec_channel
        self.side = side
        self.spec = spec
        self.server = RemoteServer(side)
        self.requests: dict[int, InferenceRequest] = {}  # open decoupled requests by key
        self.bls_loop = asyncio.new_event_loop()

    def run(self) -> None:
        """Serve until finalize or until the server goes away; then leave at once (see `_exit`)."""
        threading.Thread(target=self.bls_loop.run_forever, daemon=True, name="naiad-bls-loop").start()
        threading.Thread(target=self._read_side, daemon=True, name="naiad-worker-side").start()
        instance = self._start()
        if instance is None:
            _exit()
        # Wait for the next call in poll, not in a blocking read: the kernel wakes a socket's blocked reader also
        # when the server consumes a reply this worker sent (its write space grows), once per execution, while
        # poll is woken for input only. Nothing is ever left buffered between calls: the server sends one at a
        # time and waits for the reply.
        incoming = select.poll()
        incoming.register(self.exec.sock, select.POLLIN)
        while True:
            try:
                incoming.poll()
                message = self.exec.recv()
            except (EOFError, OSError):
                _exit()  # the server went away: nobody is left to answer
            if message[0] == "execute":
                self._execute(instance, *message[1:])
                continue
            try:  # finalize
                instance.close()
            except BaseException as exc:
                self._reply(None, as_naiad_error(exc))
            else:
                self._reply(None, None)
            _exit()

    def _start(self) -> PythonInstance | None:
        spec = self.spec
        config = mc.ModelConfig.FromString(spec["config"])
        ctx = ModelContext(
            name=spec["name"],
            version=spec["version"],
            config=config,
            model_dir=Path(spec["model_dir"]),
            version_dir=Path(spec["version_dir"]),
            server=self.server,
            loop=self.bls_loop,
        )
        group = mc.ModelInstanceGroup.FromString(spec["group"])
        try:
            instance = PythonInstance(ctx, group, spec["device_id"], spec["index"])
            instance.warmup_thread_init()
        except BaseException as exc:
            self._reply(None, as_naiad_error(exc))
            return None
        self._reply(os.getpid(), None)
        return instance

    def _execute(self, instance: PythonInstance, fields: list[tuple], keys: list[int | None]) -> None:
        requests = []
        for f, key in zip(fields, keys):
            callback = None if key is None else partial(self._send_response, key)
            request = decode_request(f, callback)
            if key is not None:
                self.requests[key] = request
            requests.append(request)
        started = time.monotonic_ns()
        try:
            responses = instance.execute(requests, Timing())
        except BaseException as exc:
            for key in keys:
                self.requests.pop(key, None)
            self._reply(None, as_naiad_error(exc))
            return
        encoded = [encode_response(r) for r in responses]
        self._reply((encoded, started, time.monotonic_ns(), self.side.sent), None)

    def _send_response(self, key: int, response: InferenceResponse) -> None:
        """A decoupled response (any model thread): to the parent, which calls the request's callback."""
        if response.final:
            self.requests.pop(key, None)
        self.side.send(("response", key, encode_response(response)))

    def _reply(self, value, error) -> None:
        try:
            self.exec.send(("reply", value, error))
        except PICKLE_ERRORS as exc:  # e.g. an output tensor of objects that do not pickle
            self.exec.send(
                (
                    "reply",
                    None,
                    Internal(
                        f"model '{self.spec['name']}': cannot send the result to "
                        f"the server: {type(exc).__name__}: {exc}"
                    ),
                )
            )

    def _read_side(self) -> None:
        while True:
            try:
                message = self.side.recv()
            except (EOFError, OSError):
                # The parent closes the channels only once this process has exited (or to end it), so this is
                # the server going away, perhaps while the model waits on a BLS call that will never return.
                _exit()
            kind = message[0]
            if kind == "call_reply":
                self.server.call_reply(*message[1:])
            elif kind == "bls_reply":
                self.server.reply(*message[1:])
            elif kind == "bls_stream":
                self.server.stream(*message[1:])
            elif kind == "cancel":
                request = self.requests.get(message[1])
                if request is not None:
                    request.cancelled = True


def _exit() -> None:
    """Leave without waiting for threads a model may have left running (Triton's stub does the same)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(exec_sock: socket.socket, side_sock: socket.socket, spec: dict) -> None:
    """Entry point of the spawned process."""
    # Ctrl-C, `timeout` and systemd signal the whole process group, but the server drains in-flight requests
    # before it unloads models: the worker ends with finalize, or when the server's sockets close. It was started
    # with these signals blocked (process.py): ignoring them discards any pending, then they are unblocked.
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)
    side = Channel(side_sock)
    root = logging.getLogger()
    root.handlers[:] = [_ForwardLogs(side)]
    root.setLevel(spec["log_level"])
    Worker(Channel(exec_sock), side, spec).run()
