"""What crosses between a frontend worker and the engine: msgspec messages in length-prefixed frames over a Unix
socket, with tensor bytes inline when small and in a shared-memory slab (read in place) when large."""

from __future__ import annotations

import struct
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from .. import errors, tensors
from ..inference import InferenceRequest, InferenceResponse, OutputTensor, RequestedOutput
from .slabs import SlabMaps, SlabPool

INLINE_LIMIT = 64 * 1024  # tensors up to this many bytes ride in the message; larger ones in a slab
_INLINE_KINDS = frozenset("biufcV")  # numpy dtype kinds whose bytes are the tensor (not object arrays)
_DTYPES: dict[str, np.dtype] = {}  # numpy's dtype for each dtype string seen
_DTYPE_STRS: dict[np.dtype, str] = {}  # each dtype of those kinds seen, and its string (`.str` costs 0.14 µs)
_ALIGN = 64
LENGTH = struct.Struct("<I")  # the length prefix of a frame


class Tensor(msgspec.Struct, array_like=True):
    name: str
    datatype: str
    dtype: str  # numpy's dtype string of the array ("" for BYTES, which travel serialized)
    shape: tuple[int, ...]  # (a tuple: numpy takes one as it is, a list it converts, 0.2 µs a tensor)
    data: bytes | None = None  # inline
    offset: int = 0  # in the message's slab
    nbytes: int = 0
    peer: bool = False  # an output whose bytes are the request's own, at `offset` in the request's slab
    cuda: dict[str, Any] | None = None  # in a CUDA shared memory region: its `shared_memory_*` parameters


class Request(msgspec.Struct, array_like=True):
    model_name: str
    model_version: int
    id: str
    inputs: list[Tensor]
    outputs: list[RequestedOutput]  # (a dataclass: msgspec makes them as it decodes, 0.17 µs a request less)
    parameters: dict[str, Any]
    priority: int
    timeout_us: int
    correlation_id: int | str
    flags: int
    traceparent: str | None
    slab: str = ""
    # when the worker made the request (CLOCK_MONOTONIC, one clock for every process): statistics, queue
    # timeouts and traces count from there, as in one process, not from the engine's reading of it
    arrival_ns: int = 0


class Response(msgspec.Struct, array_like=True):
    model_name: str
    model_version: str
    id: str
    outputs: list[Tensor]
    parameters: dict[str, Any]
    final: bool
    error: tuple[str, str] | None = None
    slab: str = ""
    # the request waited this long for its model to load on demand (the engine loaded it)
    load_wait_ns: int = 0


class CudaSpan:
    """A tensor in a client's CUDA shared memory region, by its `shared_memory_*` parameters: the engine holds the
    regions' IPC mappings, so it reads such an input (when it decodes the request) and writes such an output
    (before it replies); a worker only passes the span along."""

    __slots__ = ("datatype", "params", "shape")

    def __init__(self, datatype: str, shape: list[int] | tuple[int, ...], params: dict[str, Any]):
        self.datatype = datatype
        self.shape = tuple(shape)
        self.params = params


# ---- messages (the first element of each frame's array is its tag) ----


class Hello(msgspec.Struct, tag="h", array_like=True):
    pid: int
    prefix: str  # the worker's slab names start with this
    control: bool  # the blocking control channel (one call at a time) rather than the data channel


class Infer(msgspec.Struct, tag="i", array_like=True):
    id: int
    request: Request


class Stream(msgspec.Struct, tag="s", array_like=True):
    id: int
    request: Request


class Cancel(msgspec.Struct, tag="x", array_like=True):
    id: int


class Call(msgspec.Struct, tag="c", array_like=True):
    id: int
    method: str
    args: list[Any]


class Free(msgspec.Struct, tag="f", array_like=True):
    slabs: list[str]


class Unmap(msgspec.Struct, tag="u", array_like=True):
    # segments the sender unlinked: the peer drops its mappings of them, so their memory returns
    slabs: list[str]


class Reply(msgspec.Struct, tag="r", array_like=True):
    id: int
    response: Response
    tracing: bool  # the engine's tracer is active (workers read the traceparent header only then)
    shm_generation: int  # changes whenever a system shared memory region is (un)registered


class Value(msgspec.Struct, tag="v", array_like=True):
    id: int
    value: Any


class Error(msgspec.Struct, tag="e", array_like=True):
    id: int
    kind: str  # a naiad.errors class name
    message: str
    retry_after: float | None = None  # when the client may come back (HTTP Retry-After, gRPC retry-after)


Message = Hello | Infer | Stream | Cancel | Call | Free | Unmap | Reply | Value | Error


def _enc_hook(obj: Any) -> Any:
    """numpy scalars (a model's response parameters) as Python ones; anything else by its text."""
    item = getattr(obj, "item", None)
    return item() if callable(item) else str(obj)


encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
decoder = msgspec.msgpack.Decoder(Message)


def frame(msg: Message) -> bytes:
    body = encoder.encode(msg)
    return LENGTH.pack(len(body)) + body


def error_of(exc: BaseException) -> tuple[str, str, float | None]:
    """An `Error` message's kind, message and retry_after for an exception: the kind is the nearest class of
    `errors` (a subclass defined elsewhere, limits.PromptTooLong say, crosses as the class it refines)."""
    err = errors.as_naiad_error(exc)
    kind = next(c for c in type(err).__mro__ if getattr(errors, c.__name__, None) is c)
    return kind.__name__, err.message, err.retry_after


def raise_error(kind: str, message: str, retry_after: float | None = None) -> errors.NaiadError:
    """The error an `Error` message (or a response's error) describes, to raise as the engine raised it."""
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.NaiadError)):
        cls = errors.Internal
    err = cls(message)
    if retry_after is not None:
        err.retry_after = retry_after
    return err


def exception(msg: Error) -> errors.NaiadError:
    """The error an `Error` message carries."""
    return raise_error(msg.kind, msg.message, msg.retry_after)


# ---- tensors ----


def pack_tensors(
    items: list[tuple[str, str, Any]], pool: SlabPool, peer: np.ndarray | None = None
) -> tuple[list[Tensor], str]:
    """Describe tensors for the peer: small ones inline, the rest copied once into one slab of `pool`, or, when
    they all lie in one shared receive buffer (a worker's request body), described where they are. With
    `peer` (the request's slab, as mapped here), an output that lies in it is described by its offset there,
    not copied: a model that answers with (a view of) its input."""
    out: list[Tensor] = []
    base = end = 0
    if peer is not None:
        base = peer.__array_interface__["data"][0]
        end = base + peer.nbytes
    big: list[tuple[Tensor, Any, np.ndarray | None]] = []
    total = 0
    for name, datatype, arr in items:
        kind = type(arr)
        # the common case first: a small numeric array rides inline, one copy (tobytes)
        if kind is np.ndarray and arr.nbytes <= INLINE_LIMIT and datatype != "BYTES":
            dstr = _DTYPE_STRS.get(arr.dtype)
            if dstr is None and arr.dtype.kind in _INLINE_KINDS:
                dstr = _DTYPE_STRS[arr.dtype] = arr.dtype.str
            if dstr is not None:
                out.append(Tensor(name, datatype, dstr, arr.shape, arr.tobytes()))
                continue
        if kind is CudaSpan:
            out.append(Tensor(name, datatype, "", arr.shape, cuda=arr.params))
            continue
        arr = np.asarray(arr)
        if datatype == "BYTES" or arr.dtype == np.object_:
            raw: Any = tensors.serialize_bytes(arr)
            dtype = ""
        else:
            arr = np.ascontiguousarray(arr)
            raw = arr.reshape(-1).view(np.uint8).data  # (a memoryview of it)
            dtype = arr.dtype.str
        t = Tensor(name, datatype, dtype, arr.shape)
        n = len(raw)
        if base and n > INLINE_LIMIT and dtype:
            at = arr.__array_interface__["data"][0]
            if base <= at and at + n <= end:
                t.offset, t.nbytes, t.peer = at - base, n, True
                out.append(t)
                continue
        if n <= INLINE_LIMIT:
            t.data = raw if isinstance(raw, bytes) else bytes(raw)
        else:
            t.offset, t.nbytes = total, n
            total += (n + _ALIGN - 1) // _ALIGN * _ALIGN
            big.append((t, raw, arr if dtype else None))
        out.append(t)
    if not big:
        return out, ""
    arrays = [a for _, _, a in big if a is not None]
    lent = pool.lend(arrays) if len(arrays) == len(big) else None
    if lent is not None:  # every array has an address: each is described by its place in the lent buffer
        name, start = lent
        for (t, _, _), a in zip(big, arrays, strict=True):
            t.offset = a.__array_interface__["data"][0] - start
        return out, name
    slab = pool.alloc(total)
    dst = slab.array
    for t, raw, _ in big:
        dst[t.offset : t.offset + t.nbytes] = np.frombuffer(raw, np.uint8)
    return out, slab.name


def _holder(buf: np.ndarray, items: list[Tensor], release: Callable[[str], None], slab: str) -> np.ndarray:
    end = max(t.offset + t.nbytes for t in items)
    # an array over a memoryview, so numpy keeps every view's base pointing here (and the finalizer honest)
    holder = np.frombuffer(buf.data[:end], np.uint8)  # (`data`: a memoryview of `buf`)
    weakref.finalize(holder, release, slab)
    return holder


def unpack_tensors(
    items: list[Tensor],
    slab: str,
    maps: SlabMaps,
    release: Callable[[str], None],
    own: tuple[str, np.ndarray, Callable[[str], None]] | None = None,
) -> list[tuple[str, str, Any]]:
    """Arrays for described tensors (a `CudaSpan` for one in CUDA shared memory); those in a slab are views of
    it, and `release(slab)` runs once every view (and anything made from one) is gone. `own`: (name, bytes,
    release) of this side's request slab, for outputs the peer described in it."""
    holder = peer_holder = None
    if slab:
        in_slab = [t for t in items if t.data is None and not t.peer and t.cuda is None]
        holder = _holder(maps.view(slab), in_slab, release, slab)
    if own is not None:
        name, buf, release_own = own
        peer_holder = _holder(buf, [t for t in items if t.peer], release_own, name)
    out: list[tuple[str, str, Any]] = []
    for t in items:
        raw: Any = t.data
        if raw is not None and t.dtype:  # the common case: a small numeric tensor, over the message's bytes
            out.append((t.name, t.datatype, np.ndarray(t.shape, _dtype(t.dtype), raw)))
            continue
        if t.cuda is not None:
            out.append((t.name, t.datatype, CudaSpan(t.datatype, t.shape, t.cuda)))
            continue
        if raw is None:
            src = peer_holder if t.peer else holder
            assert src is not None  # (a tensor in a slab: its message named the slab, or the peer's request)
            raw = src[t.offset : t.offset + t.nbytes]
        if not t.dtype:
            arr = tensors.deserialize_bytes(raw).reshape(t.shape)
        else:
            arr = raw.view(_dtype(t.dtype)).reshape(t.shape)
        out.append((t.name, t.datatype, arr))
    return out


def _dtype(text: str) -> np.dtype:
    dt = _DTYPES.get(text)
    if dt is None:
        dt = _DTYPES[text] = np.dtype(text)
    return dt


def encode_request(req: InferenceRequest, pool: SlabPool) -> Request:
    items = [(name, req.datatypes.get(name, ""), arr) for name, arr in req.inputs.items()]
    inputs, slab = pack_tensors(items, pool)
    tp = req.traceparent if isinstance(req.traceparent, str) else None
    return Request(
        req.model_name,
        req.model_version,
        req.id,
        inputs,
        req.outputs,
        req.parameters,
        req.priority,
        req.timeout_us,
        req.correlation_id,
        req.flags,
        tp,
        slab,
        req.arrival_ns,
    )


def decode_request(
    msg: Request, maps: SlabMaps, release: Callable[[str], None], shm: Any = None
) -> InferenceRequest:
    """The request a worker described; inputs in CUDA shared memory are read through `shm`, the engine's
    manager (checked now, copied once the model is known, as in a single process)."""
    inputs: dict[str, Any] = {}
    datatypes: dict[str, str] = {}
    device = False
    for name, datatype, arr in unpack_tensors(msg.inputs, msg.slab, maps, release):
        if type(arr) is CudaSpan:
            cuda = getattr(shm, "cuda", None)
            if cuda is None:
                raise errors.InvalidArgument("CUDA shared memory is not supported by this server")
            arr = cuda.read_input(name, datatype, list(arr.shape), arr.params)
            device = device or not isinstance(arr, np.ndarray)
        inputs[name] = arr
        datatypes[name] = datatype
    return InferenceRequest(
        msg.model_name,
        inputs,
        datatypes,
        msg.model_version,
        msg.id,
        msg.outputs,
        msg.parameters,
        msg.priority,
        msg.timeout_us,
        msg.correlation_id,
        msg.flags,
        msg.arrival_ns or time.monotonic_ns(),
        None,  # response_callback
        False,  # cancelled
        None,  # trace
        msg.traceparent,
        device,
    )


def encode_response(
    resp: InferenceResponse,
    pool: SlabPool,
    peer: np.ndarray | None = None,
    spans: dict[str, CudaSpan] | None = None,
) -> Response:
    """`spans`: the outputs the engine wrote into CUDA shared memory, by name: their spans travel in their place."""
    items: list[tuple[str, str, Any]]  # (pack_tensors': an array, or a CudaSpan)
    if spans is None:
        items = [(o.name, o.datatype, o.data) for o in resp.outputs]
    else:
        items = [(o.name, o.datatype, spans.get(o.name, o.data)) for o in resp.outputs]
    outputs, slab = pack_tensors(items, pool, peer) if items else ([], "")
    err = None
    if resp.error is not None:  # as the frontends report a response's error: a NaiadError as it is
        e = resp.error
        err = error_of(e)[:2] if isinstance(e, errors.NaiadError) else ("InvalidArgument", str(e))
    return Response(
        resp.model_name, resp.model_version, resp.id, outputs, resp.parameters, resp.final, err, slab
    )


def decode_response(
    msg: Response,
    maps: SlabMaps,
    release: Callable[[str], None],
    own: tuple[str, np.ndarray, Callable[[str], None]] | None = None,
) -> InferenceResponse:
    arrays = unpack_tensors(msg.outputs, msg.slab, maps, release, own)
    # by position: model_name, model_version, outputs, id, parameters, error, final
    return InferenceResponse(
        msg.model_name,
        msg.model_version,
        [OutputTensor(name, dt, arr) for name, dt, arr in arrays],
        msg.id,
        msg.parameters,
        raise_error(*msg.error) if msg.error is not None else None,
        msg.final,
    )
