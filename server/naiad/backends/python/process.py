"""Process-isolated python model instances, the server side: each instance runs `model.py` in its own worker
process (`worker.main`), spoken to in the wire format of `wire` (the choice of mode is `naiad.python_isolation`'s).

A worker that dies fails the in-flight execution and ends open decoupled streams with an error that
names its pid and signal; then, as Triton restarts its stub, a new worker is started (and `initialize`
runs again) on a thread of its own. Until it has started the instance is not ready (so neither is the
model) and requests for it wait for the restart; a worker that dies within SHORT_LIFE_S of starting, or
a restart that fails, delays the next attempt (1 s doubling to 30 s), and meanwhile requests fail at
once with the reason. Restarts are logged and counted in RESTART_METRIC on /metrics.

Workers are started with multiprocessing's "spawn" context (never fork a server that has gRPC and asyncio
threads), so a program embedding `naiad.server.Server` needs the usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import signal
import socket
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from multiprocessing import resource_tracker
from typing import Any

from ...custom_metrics import COUNTER
from ...errors import Internal, NaiadError, Unavailable
from ...inference import InferenceRequest, InferenceResponse
from ..base import ModelContext, ModelInstance, Timing
from .exec_watch import ExecWatch
from .serving import log_record, serve_call, start_bls
from .wire import (
    GROUP_SIGNALS,
    PICKLE_ERRORS,
    Channel,
    decode_response,
    encode_request,
    small_object_tensor,
)

log = logging.getLogger("naiad.python")

_live: weakref.WeakSet[ProcessInstance] = weakref.WeakSet()


@atexit.register
def _close_channels_at_exit() -> None:
    """Workers are non-daemonic (models may start processes of their own); closing their sockets makes them
    exit, so that multiprocessing's exit hook, which joins them, does not wait forever."""
    for inst in list(_live):
        inst._close_channels()


RESTART_METRIC = "nv_python_backend_stub_restart_count"
RESTART_METRIC_HELP = (
    "Number of times the python worker process (Triton's stub) of a python model instance died and was "
    "restarted"
)
RESTART_WAIT_S = 120.0  # how long a request for an instance whose worker is being restarted waits for it
SHORT_LIFE_S = 5.0  # a worker that dies sooner than this after starting delays the next restart (back-off)


class ProcessInstance(ModelInstance):
    """A python model instance whose `TritonPythonModel` lives in a worker process (see module docstring)."""

    def __init__(
        self,
        ctx: ModelContext,
        group,
        device_id: int,
        index: int,
        worker_main: Callable[[socket.socket, socket.socket, dict], None],
    ):
        """`worker_main(exec socket, side socket, spec)` is the worker process's entry point (`worker.main`)."""
        super().__init__(ctx, group, device_id, index)
        self.worker_main = worker_main
        self.decoupled = ctx.config.model_transaction_policy.decoupled
        self.pid: int | None = None
        self.restarts = 0
        self._process: multiprocessing.process.BaseProcess | None = None
        self._exec: Channel | None = None  # the instance thread's
        self._watch: ExecWatch | None = None  # the loop's reader of the exec channel (`_exchange`)
        self._side: Channel | None = None  # the reader thread's (and anyone's, to send)
        self._reader: threading.Thread | None = None
        self._lock = threading.Condition()
        self._keys = itertools.count(1)
        self._streams: dict[int, InferenceRequest] = {}  # open decoupled requests by key
        self._bls_streams: dict[int, InferenceRequest] = {}  # decoupled BLS requests of the worker, by id
        self._in_flight: set[int] = set()  # keys of the execution in progress
        self._cancel_sent: set[int] = set()
        self._side_seen = 0  # side messages the reader has handled
        self._dead: NaiadError | None = None
        self._exit_expected = False  # after finalize, or when initialize failed
        # Each worker started is a generation; the death of one is recorded once (the instance and reader
        # threads both notice it), and what an older generation's reader reports later is ignored.
        self._generation = 0
        self._gone_generation = 0
        self._starting = False
        self._restarting = False  # a restart attempt is under way: requests wait for it
        self._failures = 0  # short-lived workers in a row: the restart back-off
        self._started_at = 0.0
        # Start, restart and close exclude each other: after a failed load the repository may close instances
        # that are still starting on their own threads.
        self._life = threading.Lock()
        self._exec_lock = threading.Lock()  # held while the exec channel is in use
        self._closed = False
        self._closing = threading.Event()
        self._gone_lock = threading.Lock()
        self._restart_metric: int | None = None
        self.metrics_owner = object()  # owns the worker's custom metrics and the restart counter

    # ---- lifecycle ----
    def warmup_thread_init(self) -> None:
        """Start the worker (on the instance thread: instances start in parallel); wait for initialize."""
        with self._life:
            if self._closed:
                raise Unavailable(f"model '{self.ctx.name}' instance '{self.name}' is unloaded")
            if self._process is None:
                self._starting = True
                try:
                    self._start()
                except BaseException:
                    self._exit_expected = True  # the load fails: nothing to restart
                    raise
                finally:
                    self._starting = False
                self._count_restarts(0)

    def ready(self) -> bool:
        """Whether the instance can serve now: its worker runs (not dead, not being restarted)."""
        return self._process is not None and self._dead is None and not self._closed

    def _start(self) -> None:
        exec_parent, exec_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        side_parent, side_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
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
        context = multiprocessing.get_context("spawn")
        process = context.Process(
            target=self.worker_main,
            args=(exec_child, side_child, spec),
            name=f"naiad-python-{self.ctx.name}-{self.name}",
        )
        # Ctrl-C, a pod's stop, `timeout` and systemd signal the whole process group, and a worker ignores those
        # signals only once `worker.main` runs, after Python's start-up and imports (a second or more on a busy
        # node). Started with them blocked, it keeps any that arrive meanwhile pending until it ignores them.
        # (multiprocessing starts its resource tracker on the first start, then unblocks these very signals: so
        # that is done first.)
        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
        try:
            process.start()
        except BaseException:
            exec_parent.close()
            side_parent.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            exec_child.close()
            side_child.close()
        self._generation += 1
        self._exit_expected = False
        self._side_seen = 0
        self._started_at = time.monotonic()
        self._process = process
        self._exec, self._side = Channel(exec_parent), Channel(side_parent)
        _live.add(self)
        self._reader = threading.Thread(
            target=self._read_side,
            args=(self._side, self._generation),
            daemon=True,
            name=f"naiad-{self.ctx.name}-{self.name}-reader",
        )
        self._reader.start()
        self.pid = self._call(None)

    def close(self) -> None:
        """Call `finalize` in the worker and reap it; a finalize error is raised, as PythonInstance does."""
        self._closing.set()
        with self._lock:
            self._restarting = False
            self._lock.notify_all()
        with self._life:
            if self._closed:
                return
            self._closed = True
            try:
                if self._process is not None:
                    self._finalize()
            finally:
                store = getattr(self.ctx.server, "custom_metrics", None)
                if store is not None:
                    store.release(self.metrics_owner)

    def _finalize(self) -> None:
        try:
            if self._dead is None:
                self._exit_expected = True
                try:
                    with self._exec_lock:  # after an execution in flight on the event loop (`_exchange`)
                        self._call(("finalize",))
                except NaiadError as exc:
                    if exc is not self._dead:  # a worker that is gone already is no error at unload
                        raise
        finally:
            self._reap()

    def _reap(self) -> None:
        self._exit_expected = True
        self._process.join(10)
        if self._process.is_alive():
            log.warning(
                "python worker of model '%s' instance '%s' did not exit after finalize; killing it",
                self.ctx.name,
                self.name,
            )
            self._process.kill()
            self._process.join(5)
        self._close_channels()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        _live.discard(self)

    def _close_channels(self) -> None:
        watch, self._watch = self._watch, None
        for channel in (self._exec, self._side):
            if channel is None:
                continue
            if watch is not None and channel is watch.channel:
                watch.close()  # (closed on the loop, which polls it)
            else:
                channel.close()

    # ---- restarting a worker that died ----
    def _restart(self, generation: int) -> None:
        """Start a new worker in place of generation `generation`, which died (own thread). A worker that died
        young, or a restart that failed, delays the next attempt (1 s doubling to 30 s); meanwhile requests
        fail at once with the reason, and during an attempt they wait for it."""
        delay = 0.0 if self._failures == 0 else min(30.0, 2.0 ** (self._failures - 1))
        if delay:
            with self._lock:
                self._restarting = False
                self._lock.notify_all()
            if self._closing.wait(delay):
                return
            with self._lock:
                self._restarting = True
        with self._life:
            if self._closed or generation != self._generation:
                return
            old_pid = self.pid
            with self._exec_lock:  # the in-flight execution has seen the end of the old worker
                self._reap()
            self._starting = True
            try:
                self._start()
            except BaseException as exc:
                error = Internal(
                    f"Failed to process the request(s) for model '{self.name}', message: the python worker "
                    f"process of model '{self.ctx.name}' died and could not be restarted: {exc}"
                )
                with self._gone_lock:
                    self._gone_generation = self._generation
                    with self._lock:
                        self._dead = error
                        self._lock.notify_all()
                self._failures += 1
                log.error("%s", error)
                threading.Thread(
                    target=self._restart,
                    args=(self._generation,),
                    daemon=True,
                    name=f"naiad-{self.name}-restart",
                ).start()
                return
            finally:
                self._starting = False
            with self._lock:
                self._dead = None
                self._restarting = False
                self._lock.notify_all()
        self.restarts += 1
        self._count_restarts(1)
        log.warning(
            "python worker of model '%s' instance '%s' restarted: pid %s replaces pid %s, which died",
            self.ctx.name,
            self.name,
            self.pid,
            old_pid,
        )

    def _count_restarts(self, n: int) -> None:
        """The restart counter (RESTART_METRIC) on /metrics; created at 0 when the worker first starts."""
        store = getattr(self.ctx.server, "custom_metrics", None)
        if store is None:
            return
        try:
            if self._restart_metric is None:
                family = store.family(RESTART_METRIC, RESTART_METRIC_HELP, COUNTER, self.metrics_owner)
                labels = {"model": self.ctx.name, "version": str(self.ctx.version), "instance": self.name}
                self._restart_metric = store.metric(family, labels, None, self.metrics_owner)
            if n:
                store.update(self._restart_metric, "increment", n)
        except NaiadError:
            log.exception("counting restarts of model '%s' failed", self.ctx.name)

    # ---- execution ----
    def execute(self, requests: list[InferenceRequest], timing: Timing) -> list[InferenceResponse | None]:
        t0 = time.monotonic_ns()
        keys: list[int | None] = [
            next(self._keys) if self.decoupled and r.response_callback is not None else None for r in requests
        ]
        streams = {k: r for k, r in zip(keys, requests) if k is not None}
        with self._lock:
            if self._dead is not None and self._restarting:
                deadline = time.monotonic() + RESTART_WAIT_S
                while self._dead is not None and self._restarting and time.monotonic() < deadline:
                    self._lock.wait(deadline - time.monotonic())
            if self._dead is not None:
                raise self._dead
            self._streams.update(streams)
            self._in_flight = set(streams)
        try:
            with self._exec_lock:
                encoded, started_ns, done_ns, side_sent = self._call(
                    ("execute", [encode_request(r) for r in requests], keys)
                )
            responses = [decode_response(r) for r in encoded]
            if self.decoupled:
                self._wait_side(side_sent)
        except BaseException:
            with self._lock:
                for key in streams:
                    self._streams.pop(key, None)
            raise
        finally:
            with self._lock:
                self._in_flight = set()
        self._account(t0, started_ns, done_ns, timing)
        return responses

    def _account(self, t0: int, started_ns: int, done_ns: int, timing: Timing) -> None:
        if self._failures and time.monotonic() - self._started_at > SHORT_LIFE_S:
            self._failures = 0
        end = time.monotonic_ns()
        # CLOCK_MONOTONIC is system-wide: the worker's stamps split the round trip as Triton's stats do.
        timing.input_ns += max(0, started_ns - t0)
        timing.infer_ns += max(0, done_ns - started_ns)
        timing.output_ns += max(0, end - done_ns)

    def execute_async(
        self, requests: list[InferenceRequest], timing: Timing
    ) -> Awaitable[list[InferenceResponse | None]] | None:
        """A small execution of a model that is not decoupled, sent to the worker from the event loop and awaited
        there: no instance thread, so no thread hand-off each way. (bench/frontend_workers.py, 4 instances,
        16-value requests at c64 on 2 cores: through the instance threads the server process spent 343 µs of
        CPU per request, most of it waking threads and handing the GIL back and forth.) None for anything else
        (decoupled, a large request, a worker that is gone or being restarted, the channel busy with a finalize
        or restart): the instance thread runs `execute`."""
        if self.decoupled or self._dead is not None or self._exec is None:
            return None
        # BYTES tensors pickle in band: a large one is left to the thread, to be pickled once and off the loop
        if not all(small_object_tensor(a) for r in requests for a in r.inputs.values() if a.dtype.hasobject):
            return None
        if not self._exec_lock.acquire(blocking=False):
            return None
        t0 = time.monotonic_ns()
        try:
            frame = self._exec.small_frame(
                ("execute", [encode_request(r) for r in requests], [None] * len(requests))
            )
        except PICKLE_ERRORS:
            frame = None  # `execute` reports it
        if frame is None:
            self._exec_lock.release()
            return None
        return self._exchange(frame, t0, timing)

    async def _exchange(self, frame: bytes, t0: int, timing: Timing) -> list[InferenceResponse | None]:
        """Send `frame` on the exec channel and read the reply as it arrives (the caller holds `_exec_lock`;
        it is released once the reply is read, even when the awaiting task was cancelled meanwhile)."""
        loop = asyncio.get_running_loop()
        generation, channel = self._generation, self._exec
        watch = self._watch
        if watch is None or watch.channel is not channel or watch.loop is not loop:
            watch = self._watch = ExecWatch(loop, channel)
        reply: asyncio.Future = loop.create_future()

        def finish(message: tuple | None, error: BaseException | None) -> None:
            self._exec_lock.release()
            if not reply.done():
                if error is None:
                    reply.set_result(message)
                else:
                    reply.set_exception(
                        error if isinstance(error, (EOFError, OSError)) else self._undecodable(error)
                    )

        try:
            channel.send_frame(frame)
            watch.expect(finish)
        except OSError:
            self._exec_lock.release()
            raise (await asyncio.to_thread(self._worker_gone, None, generation)) from None
        try:
            _, value, error = await reply
        except (EOFError, OSError):
            # `_worker_gone` waits (briefly) for the process to be reaped: not on the event loop
            raise (await asyncio.to_thread(self._worker_gone, None, generation)) from None
        if error is not None:
            raise error
        encoded, started_ns, done_ns, _ = value
        responses = [decode_response(r) for r in encoded]
        self._account(t0, started_ns, done_ns, timing)
        return responses

    def _undecodable(self, exc: BaseException) -> Internal:
        return Internal(
            f"model '{self.ctx.name}': cannot decode the reply of the python worker of "
            f"instance '{self.name}': {type(exc).__name__}: {exc}"
        )

    def _call(self, message: tuple | None) -> Any:
        """One exchange on the exec channel; None only waits for the worker's greeting (pid or init error)."""
        generation = self._generation
        try:
            if message is not None:
                # an exchange on the event loop (`_exchange`) leaves the descriptor non-blocking (libuv's poll
                # handle sets O_NONBLOCK); this thread's reads block
                self._exec.sock.setblocking(True)
                try:
                    self._exec.send(message)
                except PICKLE_ERRORS as exc:
                    raise Internal(
                        f"model '{self.ctx.name}': cannot send the request(s) to the python "
                        f"worker of instance '{self.name}': {exc}"
                    ) from None
            try:
                reply = self._exec.recv()
            except (EOFError, OSError):
                raise
            except Exception as exc:
                raise self._undecodable(exc) from None
        except (EOFError, OSError):
            raise self._worker_gone(None, generation) from None
        _, value, error = reply
        if error is not None:
            if message is None:
                self._exit_expected = True
            raise error
        return value

    def _wait_side(self, side_sent: int) -> None:
        """Wait until the reader handled what the worker sent on the side channel during the execution."""
        with self._lock:
            while self._side_seen < side_sent and self._dead is None:
                self._lock.wait()

    # ---- the reader thread ----
    def _read_side(self, channel: Channel, generation: int) -> None:
        reason = None
        try:
            while True:
                message = channel.recv()
                self._dispatch(message)
                with self._lock:
                    if generation == self._generation:
                        self._side_seen += 1
                    self._lock.notify_all()
        except (EOFError, OSError, ValueError):  # ValueError: the channel was closed under the reader
            pass
        except Exception as exc:
            reason = f"undecodable message from the worker: {type(exc).__name__}: {exc}"
            if generation == self._generation:
                self._process.kill()
        self._worker_gone(reason, generation)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "response":
            self._deliver(message[1], decode_response(message[2]))
        elif kind == "bls":
            start_bls(self.ctx, self._send_side, self._bls_streams, self._lock, *message[1:])
        elif kind == "bls_cancel":
            with self._lock:
                native = self._bls_streams.get(message[1])
            if native is not None:
                native.cancelled = True
        elif kind == "call":
            serve_call(self.ctx, self.metrics_owner, self._send_side, *message[1:])
        elif kind == "metric_update":
            _, metric, op, value = message
            try:
                self.ctx.server.custom_metrics.update(metric, op, value)
            except (AttributeError, NaiadError) as exc:
                log.warning("model '%s': a custom metric update failed: %s", self.ctx.name, exc)
        elif kind == "log":
            log_record(*message[1:])

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
        except Exception:
            log.exception("delivering a response of model '%s' failed", self.ctx.name)
        if native.cancelled and not response.final:
            with self._lock:
                first = key not in self._cancel_sent
                self._cancel_sent.add(key)
            if first:
                self._send_side(("cancel", key))

    def _send_side(self, message: tuple) -> None:
        """Send from the reader or the server loop; a worker that has gone away no longer needs it."""
        try:
            self._side.send(message)
        except (OSError, ValueError):
            pass
        except PICKLE_ERRORS as exc:  # e.g. a BLS response holding objects that do not pickle
            if message[0] in ("bls_reply", "bls_stream", "call_reply"):
                self._send_side(
                    (
                        message[0] if message[0] == "call_reply" else "bls_reply",
                        message[1],
                        None,
                        Internal(f"cannot send the answer to the python worker: {exc}"),
                    )
                )

    # ---- the worker going away ----
    def _worker_gone(self, reason: str | None, generation: int) -> NaiadError:
        """Record why worker `generation` is gone (once), end open streams, start a new worker when it died
        unexpectedly, and return the error for requests."""
        with self._gone_lock:
            if generation != self._generation or generation == self._gone_generation:
                return self._dead or Unavailable(
                    f"model '{self.ctx.name}' instance '{self.name}' is unloaded"
                )
            self._gone_generation = generation
            error = self._exit_error(reason)
            restart = not self._exit_expected and not self._closed and not self._starting
            if restart:
                young = time.monotonic() - self._started_at < SHORT_LIFE_S
                self._failures = self._failures + 1 if young else 0
            with self._lock:
                self._dead = error
                self._restarting = restart
                ended = [r for k, r in self._streams.items() if k not in self._in_flight]
                self._streams.clear()
                self._bls_streams.clear()
                self._lock.notify_all()
        if isinstance(error, Internal):
            log.error("%s", error)
        for native in ended:
            try:
                native.response_callback(
                    InferenceResponse(
                        model_name=native.model_name,
                        model_version=str(native.model_version),
                        id=native.id,
                        error=error,
                        final=True,
                    )
                )
            except Exception:
                log.exception("ending a stream of model '%s' failed", self.ctx.name)
        if restart:
            threading.Thread(
                target=self._restart, args=(generation,), daemon=True, name=f"naiad-{self.name}-restart"
            ).start()
        return error

    def _exit_error(self, reason: str | None) -> NaiadError:
        if self._exit_expected and reason is None:
            return Unavailable(f"model '{self.ctx.name}' instance '{self.name}' is unloaded")
        self._process.join(2)
        code = self._process.exitcode
        if reason is None:
            reason = "it closed its connection" if code is None else f"exit code {code}"
            if code is not None and code < 0:
                try:
                    reason = f"killed by {signal.Signals(-code).name}"
                except ValueError:
                    pass
        then = "" if self._closed or self._starting else "; it is being restarted"
        return Internal(
            f"Failed to process the request(s) for model '{self.name}', message: the python "
            f"worker process (pid {self._process.pid}) of model '{self.ctx.name}' exited "
            f"unexpectedly ({reason}){then}"
        )
