"""Naiad's `triton_python_backend_utils`: python_backend's public API, which Triton python models import.

Models run unmodified: `import triton_python_backend_utils as pb_utils` resolves to this module (the package
registers it). Only the public names live here; binding a thread to a server is `context`'s, turning what a
model returns into the server's responses is `convert`'s.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import struct
import threading

import numpy as np

from ... import custom_metrics as _cm
from ... import device_tensors as _dev
from ... import tensors as _t
from ...errors import NaiadError as _NaiadError
from ...trace import Nested as _Nested
from . import context as _bound
from . import convert as _convert

_log = logging.getLogger("naiad.python_model")

# ---- constants (values as in tritonserver.h) ----
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

TRITONSERVER_TYPE_INVALID = 0
TRITONSERVER_TYPE_BOOL = 1
TRITONSERVER_TYPE_UINT8 = 2
TRITONSERVER_TYPE_UINT16 = 3
TRITONSERVER_TYPE_UINT32 = 4
TRITONSERVER_TYPE_UINT64 = 5
TRITONSERVER_TYPE_INT8 = 6
TRITONSERVER_TYPE_INT16 = 7
TRITONSERVER_TYPE_INT32 = 8
TRITONSERVER_TYPE_INT64 = 9
TRITONSERVER_TYPE_FP16 = 10
TRITONSERVER_TYPE_FP32 = 11
TRITONSERVER_TYPE_FP64 = 12
TRITONSERVER_TYPE_BYTES = 13
TRITONSERVER_TYPE_BF16 = 14

_TYPE_NAMES = [
    "INVALID",
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
    "BF16",
]
_TYPE_BY_NAME = {n: i for i, n in enumerate(_TYPE_NAMES)}


class MemoryType:
    """Where a BLS caller would like its outputs (python_backend's values, not tritonserver.h's)."""

    TRITONSERVER_MEMORY_GPU = 0
    TRITONSERVER_MEMORY_CPU = 1


TRITONSERVER_MEMORY_GPU = MemoryType.TRITONSERVER_MEMORY_GPU
TRITONSERVER_MEMORY_CPU = MemoryType.TRITONSERVER_MEMORY_CPU


class PreferredMemory:
    """Accepted for API compatibility; Naiad's python models always get CPU (numpy) tensors."""

    def __init__(self, preferred_memory_type=TRITONSERVER_MEMORY_CPU, preferred_device_id=0):
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


# ---- datatype helpers ----


def triton_to_numpy_type(data_type: int):
    name = _TYPE_NAMES[data_type] if 0 <= data_type < len(_TYPE_NAMES) else "INVALID"
    if name == "INVALID":
        return None
    if name == "BYTES":
        return np.object_
    return _t.numpy_dtype(name).type


def numpy_to_triton_type(data_type) -> int | None:
    dt = np.dtype(data_type)
    if dt.kind in ("O", "S", "U"):
        return TRITONSERVER_TYPE_BYTES
    try:
        return _TYPE_BY_NAME[_t.datatype_of(np.empty(0, dt))]
    except _NaiadError:
        return None


# config.pbtxt data type -> numpy type (BF16 has no numpy type, as in Triton)
TRITON_STRING_TO_NUMPY = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


def triton_string_to_numpy(triton_type_string: str):
    """'TYPE_FP32' (or 'FP32') -> numpy type."""
    known = TRITON_STRING_TO_NUMPY.get(triton_type_string)
    if known is not None:
        return known
    name = triton_type_string[5:] if triton_type_string.startswith("TYPE_") else triton_type_string
    if name in ("STRING", "BYTES"):
        return np.object_
    return _t.numpy_dtype(name).type


def serialize_byte_tensor(input_tensor: np.ndarray):
    """BYTES elements as Triton's wire format (4-byte little-endian length, then the bytes), in C order.

    As python_backend: `bytes` for an object or bytes tensor, an empty tuple for an empty tensor, None for
    any other dtype; str elements are UTF-8 encoded, other objects by their `str()`."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type is not np.bytes_:
        return None
    parts = []
    for item in input_tensor.ravel(order="C"):
        if input_tensor.dtype == np.object_ and not isinstance(item, bytes):
            item = str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(item)))
        parts.append(bytes(item))
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor) -> np.ndarray:
    return _t.deserialize_bytes(bytes(encoded_tensor))


# ---- errors ----


class TritonError(Exception):
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL):
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message


class TritonModelException(Exception):
    def __init__(self, msg: str = ""):
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg


# ---- tensors ----


class Tensor:
    """A named tensor held as a numpy array (zero-copy views where the request allows), or in GPU memory as a
    `device_tensors.DeviceTensor` (only for a model with FORCE_CPU_ONLY_INPUT_TENSORS "no")."""

    __slots__ = ("_array", "_datatype", "_name")

    def __init__(self, name: str, tensor, datatype: str | None = None):
        if not isinstance(tensor, (np.ndarray, _dev.DeviceTensor)):
            tensor = np.asarray(tensor)
        if tensor.dtype.kind in ("S", "U"):
            tensor = tensor.astype(np.object_)
        self._name = name
        self._array = tensor
        self._datatype = datatype or _t.datatype_of(tensor)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        if self._array.__class__ is _dev.DeviceTensor:
            raise TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return _TYPE_BY_NAME[self._datatype]

    def is_cpu(self) -> bool:
        return self._array.__class__ is not _dev.DeviceTensor

    def to_dlpack(self):
        return self._array.__dlpack__()

    def __dlpack__(self, stream=None, **kwargs):
        # a consumer that reads versioned DLPack (numpy >= 2.1, torch) also takes a read-only request buffer
        return self._array.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, dlpack_tensor) -> Tensor:
        """From an object with `__dlpack__` (a torch tensor, a Tensor, ...) or a raw DLPack capsule. GPU memory
        stays on the GPU for a model with FORCE_CPU_ONLY_INPUT_TENSORS "no"; other models get a host copy."""
        keep_device = _bound.device_tensors()
        if hasattr(dlpack_tensor, "__dlpack__"):
            source = dlpack_tensor
            if _dev.is_device(source):
                if keep_device:
                    return Tensor(name, _dev.DeviceTensor(source))
                source = _dev.DeviceTensor(source).to_host()
            return Tensor(name, np.from_dlpack(source))
        try:  # a raw capsule of CPU memory (what `to_dlpack` returns) needs no framework
            return Tensor(name, np.from_dlpack(_Capsule(dlpack_tensor)))
        except (BufferError, TypeError, RuntimeError) as exc:
            reason = exc
        try:  # a capsule of device memory, as torch.utils.dlpack.to_dlpack returns for a CUDA tensor
            import torch.utils.dlpack as tdl
        except ImportError:
            raise TritonModelException(f"Tensor.from_dlpack: cannot read the capsule: {reason}") from None
        device = _dev.DeviceTensor(tdl.from_dlpack(dlpack_tensor))
        return Tensor(name, device if keep_device else device.to_host())

    def __repr__(self) -> str:
        return f"Tensor(name={self._name!r}, datatype={self._datatype}, shape={self.shape()})"


class _Capsule:
    """Lets numpy import a raw DLPack capsule, which it only takes through the `__dlpack__` protocol."""

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, stream=None, **_):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


# ---- server context for BLS (set on each instance thread) ----


def _target():
    server, loop = _bound.server(), _bound.loop()
    if server is None:
        raise TritonModelException("BLS requests need a running Naiad server")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise TritonModelException("BLS exec() cannot run on the server's event loop thread")
    return server, loop


# ---- requests and responses ----


class InferenceTrace:
    """A request's trace as its model sees it (`request.trace()`): given to a BLS request (`trace=`), the call
    becomes a child of this request in the trace."""

    def __init__(self, traceparent: str | None = None):
        self._traceparent = traceparent

    def get_context(self, mode: str = "opentelemetry") -> str | None:
        """The OpenTelemetry context as JSON (`{"traceparent": ...}`), or None when the request is not traced."""
        return json.dumps({"traceparent": self._traceparent}) if self._traceparent else None


class InferenceResponse:
    def __init__(self, output_tensors=None, error: TritonError | None = None, parameters=None):
        self._outputs = list(output_tensors or [])
        if error is not None and not isinstance(error, TritonError):
            error = TritonError(str(error))
        self._error = error
        if isinstance(parameters, str):
            parameters = json.loads(parameters) if parameters else {}
        self._parameters = dict(parameters or {})

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return json.dumps(self._parameters)


class InferenceResponseSender:
    """Sends responses of a decoupled model's request, from any thread."""

    def __init__(self, request: InferenceRequest):
        self._request = request
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        with self._lock:
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            if final:
                self._closed = True
        if response is None and not final:
            raise TritonModelException(
                "Inference Response object must be provided when the flags is not FINAL"
            )
        deliver = self._request._native.response_callback
        if deliver is None:
            raise TritonModelException("this request does not accept decoupled responses")
        deliver(_convert.to_native(self._request, response, final))

    def is_cancelled(self) -> bool:
        return self._request.is_cancelled()


class InferenceRequest:
    """Incoming request handed to `execute`, or a BLS request built by a model and sent with exec()."""

    def __init__(
        self,
        model_name: str = "",
        inputs=None,
        requested_output_names=None,
        model_version: int = -1,
        correlation_id: int | str = 0,
        request_id: str = "",
        flags: int = 0,
        timeout: int = 0,
        preferred_memory=None,
        trace=None,
        parameters=None,
    ):
        if isinstance(correlation_id, bool) or not isinstance(correlation_id, (int, str)):
            raise TritonModelException("Correlation ID must be integer or string")
        self._model_name = model_name
        self._inputs = list(inputs or [])
        self._requested = list(requested_output_names or [])
        self._model_version = model_version
        self._correlation_id = correlation_id
        self._preferred_memory = preferred_memory or PreferredMemory()
        self._trace = trace if isinstance(trace, InferenceTrace) else None
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        self._request_id = request_id
        self._flags = flags
        self._timeout = timeout
        if isinstance(parameters, str):
            parameters = json.loads(parameters) if parameters else {}
        self._parameters = dict(parameters or {})
        self._native = None
        self._sender = None

    @classmethod
    def _incoming(cls, native, requested: list[str]) -> InferenceRequest:
        r = cls.__new__(cls)
        r._model_name = native.model_name
        r._inputs = [Tensor(n, a, native.datatypes.get(n)) for n, a in native.inputs.items()]
        r._requested = requested
        r._model_version = native.model_version
        r._correlation_id = native.correlation_id
        r._request_id = native.id
        r._flags = native.flags
        r._timeout = native.timeout_us
        r._parameters = native.parameters
        r._native = native
        r._sender = None
        r._preferred_memory = PreferredMemory()
        r._trace = None
        r._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        return r

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self):
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        """Sequence flags of a BLS request (TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END)."""
        self._flags = int(flags)

    def timeout(self) -> int:
        return self._timeout

    def trace(self) -> InferenceTrace:
        native = self._native
        if native is None:
            return self._trace or InferenceTrace()
        # in the server: the request's own trace; in a worker process: the context its parent sent along
        return InferenceTrace(native.trace.traceparent() if native.trace is not None else native.traceparent)

    def set_release_flags(self, flags: int) -> None:
        """RELEASE_ALL is what every request gets; RESCHEDULE needs iterative sequence batching, which Naiad's
        sequence batcher refuses at load, so no model that may reschedule can be loaded."""
        if flags == TRITONSERVER_REQUEST_RELEASE_ALL:
            self._release_flags = flags
            return
        if flags == TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            raise TritonModelException(
                "Request rescheduling needs 'sequence_batching { iterative_sequence: true }', "
                "which Naiad does not support"
            )
        raise TritonModelException(f"unknown request release flags {flags}")

    def model_name(self) -> str:
        return self._model_name

    def requested_output_names(self) -> list[str]:
        return self._requested

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def is_cancelled(self) -> bool:
        return bool(self._native is not None and self._native.cancelled)

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            self._sender = InferenceResponseSender(self)
        return self._sender

    # ---- BLS ----
    def _native_request(self):
        from ...inference import InferenceRequest as Native
        from ...inference import RequestedOutput

        inputs, datatypes = {}, {}
        device = False
        for t in self._inputs:
            inputs[t.name()] = t._array
            datatypes[t.name()] = t._datatype
            device = device or not t.is_cpu()
        return Native(
            device_inputs=device,
            device_consumer=_bound.device_tensors(),
            model_name=self._model_name,
            inputs=inputs,
            datatypes=datatypes,
            model_version=int(self._model_version),
            id=self._request_id,
            outputs=[RequestedOutput(n) for n in self._requested],
            parameters=dict(self._parameters),
            timeout_us=self._timeout,
            correlation_id=self._correlation_id,
            flags=self._flags,
            traceparent=_Nested(self._trace._traceparent)
            if self._trace and self._trace._traceparent
            else None,
        )

    def exec(self, decoupled: bool = False):
        server, loop = _target()
        native = self._native_request()
        if decoupled:
            return ResponseIterator(server, loop, native)
        fut = asyncio.run_coroutine_threadsafe(server.infer(native), loop)
        return _from_native_result(fut)

    async def async_exec(self, decoupled: bool = False):
        server, loop = _target()
        native = self._native_request()
        if decoupled:
            return ResponseIterator(server, loop, native)
        fut = asyncio.run_coroutine_threadsafe(server.infer(native), loop)
        await asyncio.wrap_future(fut)
        return _from_native_result(fut)


class ResponseIterator:
    """BLS on a decoupled model: iterate its responses as they arrive; `cancel()` asks the model to stop."""

    def __init__(self, server, loop, native):
        import queue

        self._queue: queue.Queue = queue.Queue()
        self._done = False
        self._server = server
        self._native = native

        def on_response(resp):
            self._queue.put(resp)

        native.response_callback = on_response

        async def run():
            try:
                async for _ in server.infer_stream(native):
                    pass
            except Exception as exc:
                self._queue.put(exc)
            self._queue.put(None)

        asyncio.run_coroutine_threadsafe(run(), loop)

    def __iter__(self):
        return self

    def __next__(self) -> InferenceResponse:
        while True:
            if self._done:
                raise StopIteration
            item = self._queue.get()
            if item is None:
                self._done = True
                raise StopIteration
            if isinstance(item, Exception):
                return InferenceResponse(error=TritonError(str(item)))
            return _from_native_response(item)

    def cancel(self) -> None:
        """Cancel the request: the callee sees `is_cancelled()`; responses already sent still arrive."""
        self._native.cancelled = True
        forward = getattr(self._server, "cancel_stream", None)  # a worker process tells the server
        if forward is not None:
            forward(self._native)


def _from_native_response(resp) -> InferenceResponse:
    if resp.error is not None:
        return InferenceResponse(error=TritonError(str(resp.error)))
    return InferenceResponse(
        [Tensor(o.name, o.data, o.datatype) for o in resp.outputs], parameters=resp.parameters
    )


def _from_native_result(fut) -> InferenceResponse:
    try:
        resp = fut.result()
    except Exception as exc:
        return InferenceResponse(error=TritonError(str(exc)))
    return _from_native_response(resp)


# ---- lookups ----


def get_model_dir() -> str:
    """The model version's folder (`<repository>/<model>/<version>`), where a python-based backend such as
    vllm_backend reads its files (`model.json`); Triton's stub answers the same."""
    folder = _bound.model_dir()
    if folder is None:
        raise TritonModelException("get_model_dir() is only available to a model loaded by a Naiad server")
    return folder


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for t in inference_request.inputs():
        if t.name() == name:
            return t
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    for t in inference_response.output_tensors():
        if t.name() == name:
            return t
    return None


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    """Whether the (parsed JSON) model config says `model_transaction_policy { decoupled: true }`."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    for entry in model_config.get("input", []):
        if entry.get("name") == name:
            return entry
    return None


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    for entry in model_config.get("output", []):
        if entry.get("name") == name:
            return entry
    return None


# ---- logging ----


class LogLevel:
    INFO, WARNING, ERROR, VERBOSE = 0, 1, 2, 3


class Logger:
    """Log records of the model go to the server's log (`naiad.python_model`); VERBOSE is DEBUG."""

    LogLevel = LogLevel
    INFO, WARNING, ERROR, VERBOSE = 0, 1, 2, 3

    @staticmethod
    def log(message: str, level: int = 0) -> None:
        {0: _log.info, 1: _log.warning, 2: _log.error, 3: _log.debug}.get(level, _log.info)(message)

    @staticmethod
    def log_info(message: str) -> None:
        _log.info(message)

    @staticmethod
    def log_warn(message: str) -> None:
        _log.warning(message)

    @staticmethod
    def log_error(message: str) -> None:
        _log.error(message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log.debug(message)


# ---- custom metrics (served on /metrics by the server's registry, see naiad.custom_metrics) ----


class MetricKind:
    COUNTER, GAUGE, HISTOGRAM = _cm.COUNTER, _cm.GAUGE, _cm.HISTOGRAM


COUNTER, GAUGE, HISTOGRAM = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM


def _metric_store():
    store = getattr(_bound.server(), "custom_metrics", None)
    if store is None:
        raise TritonModelException("custom metrics need a running Naiad server")
    return store


def _metric_call(fn, *args):
    try:
        return fn(*args)
    except _NaiadError as exc:
        raise TritonModelException(exc.message) from None


class MetricFamily:
    """A family of custom metrics: one kind (COUNTER, GAUGE, HISTOGRAM), one name on /metrics."""

    COUNTER, GAUGE, HISTOGRAM = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: int):
        if name is None or description is None or kind is None:
            raise TritonModelException("MetricFamily needs a name, a description and a kind")
        self._store = _metric_store()
        self._name = name
        self._kind = int(kind)
        self._id = _metric_call(self._store.family, name, description, self._kind, _bound.owner())

    def Metric(self, labels: dict | None = None, buckets: list | None = None) -> Metric:
        if labels is not None and not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        if buckets is not None and not isinstance(buckets, list):
            raise TritonModelException("Failed to create metric. Buckets must be a list.")
        return Metric(self, labels, buckets)


class Metric:
    """One labelled metric of a family: increment (counter, gauge), set (gauge), observe (histogram)."""

    def __init__(self, family: MetricFamily, labels: dict | None, buckets: list | None):
        self._family = family
        self._store = family._store
        self._id = _metric_call(self._store.metric, family._id, labels, buckets, _bound.owner())

    def _update(self, op: str, value) -> None:
        # checked here too, so that a worker process can send updates without waiting for an answer
        _metric_call(_cm.check_update, self._family._kind, op, value)
        _metric_call(self._store.update, self._id, op, value)

    def increment(self, value) -> None:
        self._update("increment", value)

    def set(self, value) -> None:
        self._update("set", value)

    def observe(self, value) -> None:
        self._update("observe", value)

    def value(self) -> float:
        return _metric_call(self._store.value, self._id)


# ---- model control from a model (explicit model control mode, as Triton) ----


def _control(method: str, *args):
    server, loop = _target()

    async def run():
        result = getattr(server, method)(*args)
        if inspect.isawaitable(result):
            result = await result
        return result

    try:
        return asyncio.run_coroutine_threadsafe(run(), loop).result()
    except _NaiadError as exc:
        raise TritonModelException(exc.message) from None


def load_model(model_name: str, config: str = "", files: dict | None = None) -> None:
    """Load (or reload) a model; `config` is a JSON model config, `files` maps "file:<path>" to bytes."""
    if model_name is None:
        raise TritonModelException("load_model needs a model name")
    _control("load_model", model_name, config or None, files or None)


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Start unloading a model and return once it is out of service (no longer ready); as Triton's, it does
    not wait for the unload to finish, so a model may unload itself from its own `execute` (vllm_backend does
    when its engine fails a health check) while that execution is still in flight."""
    if model_name is None:
        raise TritonModelException("unload_model needs a model name")
    server, loop = _target()

    async def ready() -> bool:
        answer = server.model_ready(model_name, "")
        return bool(await answer) if inspect.isawaitable(answer) else bool(answer)

    def finished(task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            _log.error("unloading model '%s' failed: %s", model_name, task.exception())

    async def run():
        task = asyncio.ensure_future(server.unload_model(model_name, bool(unload_dependents)))
        await asyncio.sleep(0)
        while not task.done() and await ready():
            await asyncio.sleep(0.002)
        if task.done():
            task.result()
        else:
            task.add_done_callback(finished)

    try:
        asyncio.run_coroutine_threadsafe(run(), loop).result()
    except _NaiadError as exc:
        raise TritonModelException(exc.message) from None


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    if model_name is None:
        raise TritonModelException("is_model_ready needs a model name")
    return bool(_control("model_ready", model_name, model_version))


# ---- auto_complete_config ----


class ModelConfig:
    """The object `TritonPythonModel.auto_complete_config` receives and returns; the checks and their
    messages are python_backend's."""

    def __init__(self, model_config: dict | str):
        self._config = json.loads(model_config) if isinstance(model_config, str) else model_config

    def _name(self) -> str:
        return str(self._config.get("name", ""))

    def as_dict(self) -> dict:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Raise only when the configuration asks for a larger max_batch_size than the model supports."""
        current = int(self._config.get("max_batch_size", 0) or 0)
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config "
                f"function for model '{self._name()}' specified max_batch_size {max_batch_size}"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but auto-complete-config "
                    f"function for model '{self._name()}' tries to set scheduling_choice as 'dynamic_batching'"
                )
        self._config.setdefault("dynamic_batching", {})

    def _add(self, kind: str, spec: dict, valid: tuple[str, ...]) -> None:
        if not isinstance(spec, dict):
            raise ValueError(
                f"{kind} in auto-complete-config function for model '{self._name()}' must be a dict"
            )
        label = f"{kind} '{spec.get('name')}'"
        extra = [key for key in spec if key not in valid]
        if extra:
            allowed = ", ".join(f"'{k}'" for k in valid[:-1]) + f" and '{valid[-1]}'"
            raise ValueError(
                f"{label} in auto-complete-config function for model '{self._name()}' contains property "
                f"other than {allowed}."
            )
        if "name" not in spec:
            raise ValueError(
                f"{kind} in auto-complete-config function for model '{self._name()}' is missing 'name' property."
            )
        for key in ("data_type", "dims"):
            if key not in spec:
                raise ValueError(
                    f"{label} in auto-complete-config function for model '{self._name()}' is missing "
                    f"'{key}' property."
                )
        entries = self._config.setdefault(kind, [])
        for entry in entries:
            if entry.get("name") != spec["name"]:
                continue
            current_type = entry.get("data_type", "TYPE_INVALID")
            if current_type != "TYPE_INVALID" and current_type != spec["data_type"]:
                raise ValueError(
                    f"unable to load model '{self._name()}', configuration expects datatype {current_type} "
                    f"for {kind} '{spec['name']}', model provides {spec['data_type']}"
                )
            if entry.get("dims") and list(entry["dims"]) != list(spec["dims"]):
                raise ValueError(
                    f"model '{self._name()}', tensor '{spec['name']}': the model expects dims "
                    f"{list(spec['dims'])} but the model configuration specifies dims {list(entry['dims'])}"
                )
            if "optional" in entry and "optional" in spec and entry["optional"] != spec["optional"]:
                raise ValueError(
                    f"model '{self._name()}', tensor '{spec['name']}': the model expects optional "
                    f"{spec['optional']} but the model configuration specifies optional {entry['optional']}"
                )
            entry["data_type"] = spec["data_type"]
            entry["dims"] = spec["dims"]
            if "optional" in spec:
                entry["optional"] = spec["optional"]
            return
        entries.append(spec)

    def add_input(self, input: dict) -> None:
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(
                    f"model transaction property in auto-complete-config function for model '{self._name()}' "
                    "contains property other than 'decoupled'."
                )
        policy = self._config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != wanted:
                raise ValueError(
                    f"trying to change decoupled property in auto-complete-config for model '{self._name()}', "
                    f"which is already set to '{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted
