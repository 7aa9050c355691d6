"""The wire format between a python model's server side and its worker process: channel, arrays, messages.

Transport: two `socket.socketpair()`s per instance. The *exec* channel carries only execute and
finalize calls and their replies, strictly one at a time: a small call is written and its reply read
on the server's event loop (`small_frame`, `send_frame`, `FrameReader`, read by `exec_watch.ExecWatch`),
any other by the instance thread (`send`, `recv`); an execution costs one wake-up each way. The *side*
channel carries everything that may happen at any time (BLS calls, decoupled responses, cancellation,
logs) and is read by a reader thread on each side, so BLS calls are served while an execution is in
flight and decoupled responses flow after `execute` returned.

A frame is a header (`<QI`: pickle length, buffer count), the out-of-band buffer lengths (`<Q`
each), the pickle (protocol 5), then the raw buffers, sent with one `sendmsg` (scatter/gather, no
user-space copy) and received with `readinto` into writable `bytearray`s that the unpickled numpy
arrays use directly: a tensor of 64 KiB or more is copied by the kernel only (smaller ones travel
inside the pickle, which is cheaper). Requests and responses travel as plain tuples (`encode_*`),
tensors as (dtype, shape, buffer) (`pack_array`): both pickle several times faster than dataclasses
and numpy's own reduction. Messages are tuples:

    exec channel
        parent -> worker  ("execute", [request fields], [stream key | None])   run a batch
                          ("finalize",)                                        call finalize, then exit
        worker -> parent  ("reply", value, error)    the first one: the worker's pid, or why initialize
                                                     failed; then (responses, t_start, t_end, side_sent)
                                                     for an execute, None for finalize
    side channel
        parent -> worker  ("bls_reply", bls, response | None, error | None)   BLS result / end of stream
                          ("bls_stream", bls, response)                       a decoupled BLS response
                          ("cancel", key)                                     a decoupled request cancelled
        worker -> parent  ("response", key, response)               a decoupled response (any thread or time)
                          ("bls", bls, request fields, decoupled)   a BLS request, run on the server loop
                          ("log", logger name, level, message)      a log record of the model

`side_sent` (side messages the worker had sent when the execution ended) lets a decoupled model's
execute return only after the responses it sent during the execution were delivered, as in-process.

The side channel also carries a worker's model control calls (`pb_utils.load_model`, ...) and custom
metric calls (`pb_utils.MetricFamily`, ...): ("call", id, method, args) answered by ("call_reply", id,
value, error), and ("metric_update", metric id, op, value) without an answer; ("bls_cancel", bls) is
`ResponseIterator.cancel()` of a decoupled BLS request.
"""

from __future__ import annotations

import pickle
import signal
import socket
import struct
import threading
from typing import Any

import numpy as np

from ...errors import Internal, NaiadError
from ...inference import InferenceRequest, InferenceResponse, OutputTensor, RequestedOutput
from ...trace import Nested

_HEADER = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")
_MAX_PARTS = 512  # stay well below IOV_MAX per sendmsg
_IN_BAND_MAX = 64 * 1024  # smaller buffers go inside the pickle: cheaper than parts and reads of their own
# Signals sent to a whole process group (Ctrl-C, a pod's stop, `timeout`): a worker is started with them blocked
# and ignores them for its life; the server decides when it ends (finalize, or its sockets closing).
GROUP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
PICKLE_ERRORS = (pickle.PicklingError, TypeError, AttributeError)  # what pickle.dumps raises for odd objects


class Channel:
    """Framed pickle-5 messages over a connected stream socket; `send` from any thread, `recv` from one."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sent = 0  # messages sent so far
        self._rfile = sock.makefile("rb", buffering=1 << 16)
        self._send_lock = threading.Lock()

    def send(self, message: tuple) -> None:
        """Pickle first (a pickling error leaves the stream intact), then write the frame atomically."""
        payload, buffers = _pickle(message)
        if not buffers and len(payload) < _IN_BAND_MAX:  # the common small message: one plain write
            frame = _HEADER.pack(len(payload), 0) + payload
            with self._send_lock:
                self.sock.sendall(frame)
                self.sent += 1
            return
        raws = [b.raw() for b in buffers]
        head = _HEADER.pack(len(payload), len(raws)) + b"".join(_LENGTH.pack(r.nbytes) for r in raws)
        parts = [memoryview(head), memoryview(payload), *raws]
        with self._send_lock:
            _sendmsg_all(self.sock, parts)
            self.sent += 1

    def small_frame(self, message: tuple) -> bytes | None:
        """`message` as one frame when it is small (no out-of-band buffer, under _IN_BAND_MAX), for `send_frame`
        on the event loop; None when it is larger (`send` it from a thread). Raises what pickling raises."""
        payload, buffers = _pickle(message)
        if buffers or len(payload) >= _IN_BAND_MAX:
            return None
        return _HEADER.pack(len(payload), 0) + payload

    def send_frame(self, frame: bytes) -> None:
        """Write a small frame without waiting for the peer when the socket has room, as it always has on an exec
        channel between executions (its buffer holds several such frames); only the rest of a partial write, if
        the kernel ever made one, is written blocking (the worker reads it at once)."""
        with self._send_lock:
            try:
                sent = self.sock.send(frame, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if sent < len(frame):
                self.sock.setblocking(True)  # the event loop's poller may have left it non-blocking
                self.sock.sendall(memoryview(frame)[sent:])
            self.sent += 1

    def recv(self) -> Any:
        """The next message; EOFError when the peer closed. The frame is read whole before unpickling, so a
        message that does not unpickle raises without desynchronising the stream."""
        size, count = _HEADER.unpack(self._read_exact(_HEADER.size))
        if not count:
            return pickle.loads(self._read_exact(size))
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
        """Shut down first: that wakes a thread blocked in `recv`, and the reader it holds can then close
        (the file object keeps the descriptor open until it is closed itself)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._rfile.close()
        self.sock.close()


class FrameReader:
    """Reads one frame of a Channel without blocking, as its bytes arrive: the event loop's side of an exchange.
    `feed()` reads what the socket holds and returns the message once the frame is complete, else None
    (messages are tuples, never None). Raises EOFError when the peer closed, and what unpickling raises. Reads
    the socket itself, so the channel's buffered reader must hold nothing: true of an exec channel between
    exchanges, where the worker sends only replies, one per call."""

    __slots__ = ("_buffers", "_count", "_header", "_payload", "_targets", "_view", "sock")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._header = bytearray(_HEADER.size)
        self._view = memoryview(self._header)  # what is being filled now
        self._targets: list[memoryview] = []  # what is filled after it
        self._payload: bytearray | None = None
        self._buffers: list[bytearray] = []
        self._count = -1  # out-of-band buffers: -1 until the header is read, then until their lengths are

    def feed(self) -> Any:
        while True:
            view = self._view
            while view.nbytes:
                try:
                    got = self.sock.recv_into(view, view.nbytes, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    self._view = view
                    return None
                if not got:
                    raise EOFError("peer closed the channel")
                view = view[got:]
            if self._targets:
                self._view = self._targets.pop(0)
                continue
            if self._payload is None:  # the header: the lengths of the out-of-band buffers come next, if any
                size, self._count = _HEADER.unpack(self._header)
                self._payload = bytearray(size)
                if self._count:
                    self._header = bytearray(_LENGTH.size * self._count)
                    self._view = memoryview(self._header)
                    continue
            elif self._count > 0 and not self._buffers:  # the lengths
                self._buffers = [bytearray(n) for (n,) in _LENGTH.iter_unpack(self._header)]
            else:
                return pickle.loads(self._payload, buffers=self._buffers)
            self._targets = [memoryview(b) for b in self._buffers]
            self._view = memoryview(self._payload)


def small_object_tensor(array: np.ndarray) -> bool:
    """Whether an object (BYTES) tensor, which pickles in band, certainly stays well under _IN_BAND_MAX: checked
    before a message is pickled on the event loop, counting its elements' lengths up to the limit."""
    if array.size * 8 >= _IN_BAND_MAX:
        return False
    total = 0
    for item in array.flat:
        total += len(item) + 8 if isinstance(item, (bytes, str)) else 64
        if total >= _IN_BAND_MAX:
            return False
    return True


def _pickle(message: tuple) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """The pickle of `message` and its out-of-band buffers (those of _IN_BAND_MAX bytes or more)."""
    buffers: list[pickle.PickleBuffer] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:  # a true value keeps it in the pickle
        if buffer.raw().nbytes < _IN_BAND_MAX:
            return True
        buffers.append(buffer)
        return False

    return pickle.dumps(message, protocol=5, buffer_callback=out_of_band), buffers


def _sendmsg_all(sock: socket.socket, parts: list[memoryview]) -> None:
    views = [p if p.format == "B" and p.ndim == 1 else p.cast("B") for p in parts if p.nbytes]
    while views:
        sent = sock.sendmsg(views[:_MAX_PARTS])
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def pack_array(array: np.ndarray):
    """A tensor as (dtype, shape, buffer): pickles ~5x faster than numpy's own reduction. Object (BYTES) and
    structured arrays are left to numpy."""
    if array.dtype.hasobject or array.dtype.fields is not None or array.dtype.subdtype is not None:
        return array
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return (array.dtype.str, array.shape, pickle.PickleBuffer(array))


def unpack_array(packed) -> np.ndarray:
    if isinstance(packed, np.ndarray):
        return packed
    dtype, shape, buffer = packed
    return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)


def encode_request(request: InferenceRequest) -> tuple:
    """What of a request crosses the process boundary, as plain values (pickled far faster than dataclasses):
    not its callback, arrival time or trace record (only the W3C context of its span, so that BLS calls from the
    worker join the trace); of the requested outputs only the names, all a model sees."""
    return (
        request.model_name,
        {n: pack_array(a) for n, a in request.inputs.items()},
        request.datatypes,
        request.model_version,
        request.id,
        [o.name for o in request.outputs],
        request.parameters,
        request.priority,
        request.timeout_us,
        request.correlation_id,
        request.flags,
        request.trace.traceparent() if request.trace is not None else _nested(request.traceparent),
    )


def _nested(traceparent) -> str | None:
    return traceparent if isinstance(traceparent, Nested) else None


def decode_request(fields: tuple, callback=None) -> InferenceRequest:
    (
        model_name,
        inputs,
        datatypes,
        model_version,
        request_id,
        outputs,
        parameters,
        priority,
        timeout_us,
        correlation_id,
        flags,
        traceparent,  # the W3C context of the calling model's span, when traced
    ) = fields
    return InferenceRequest(
        model_name=model_name,
        inputs={n: unpack_array(a) for n, a in inputs.items()},
        datatypes=datatypes,
        model_version=model_version,
        id=request_id,
        outputs=[RequestedOutput(n) for n in outputs],
        parameters=parameters,
        priority=priority,
        timeout_us=timeout_us,
        correlation_id=correlation_id,
        flags=flags,
        traceparent=Nested(traceparent) if isinstance(traceparent, str) else None,
        response_callback=callback,
    )


def encode_response(response: InferenceResponse | None) -> tuple | None:
    if response is None:
        return None
    outputs = [(o.name, o.datatype, pack_array(o.data)) for o in response.outputs]
    return (
        response.model_name,
        response.model_version,
        outputs,
        response.id,
        response.parameters,
        response.error,
        response.final,
    )


def decode_response(fields: tuple | None) -> InferenceResponse | None:
    if fields is None:
        return None
    model_name, model_version, outputs, response_id, parameters, error, final = fields
    return InferenceResponse(
        model_name=model_name,
        model_version=model_version,
        outputs=[OutputTensor(n, t, unpack_array(a)) for n, t, a in outputs],
        id=response_id,
        parameters=parameters,
        error=error,
        final=final,
    )


def transferable_error(exc: BaseException) -> NaiadError:
    """An error that pickles and keeps the text the model sees: NaiadErrors as they are, others Internal."""
    return exc if isinstance(exc, NaiadError) else Internal(str(exc))
