"""KServe v2 gRPC frontend (grpc.aio) over the service definitions shipped in tritonclient. A thin adapter."""

from __future__ import annotations

import asyncio
import hmac
import logging

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from .. import tensors
from ..errors import InvalidArgument, NaiadError, as_naiad_error
from ..inference import InferenceRequest, InferenceResponse, RequestedOutput
from ..server import Server, parse_version
from . import grpc_wire, tls
from . import shm as shm_handlers
from .common import request_options

log = logging.getLogger("naiad.grpc")

# InferTensorContents field per datatype
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def param_value(p):
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def decode_request(req: pb.ModelInferRequest, shm=None, raw=None) -> InferenceRequest:
    """ModelInferRequest -> InferenceRequest; raw contents become numpy views without copies (`raw`: the
    raw_input_contents when they were kept out of the parse, see grpc_wire.SplitInferRequest)."""
    if raw is None:
        raw = req.raw_input_contents
    n_raw = len(raw)
    used_raw = 0  # as Triton: the inputs not in shared memory take the raw entries in order
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for t in req.inputs:
        name, datatype, shape = t.name, t.datatype, list(t.shape)
        if datatype not in tensors.DATATYPES:
            raise InvalidArgument(f"input '{name}' has invalid datatype '{datatype}'")
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"input '{name}' has a negative dimension in shape {shape}")
        if name in inputs:
            raise InvalidArgument(f"input '{name}' is given more than once")
        tparams = {k: param_value(v) for k, v in t.parameters.items()} if t.parameters else {}
        if "shared_memory_region" in tparams:
            if t.HasField("contents"):
                raise InvalidArgument(
                    f"unexpected 'content' provided when using shared memory for input tensor '{name}' for "
                    f"model '{req.model_name}'"
                )
            if shm is None:
                raise InvalidArgument("shared memory is not enabled on this server")
            inputs[name] = shm.read_input(name, datatype, shape, tparams)
        elif n_raw:
            if t.HasField("contents"):
                raise InvalidArgument(
                    f"contents field must not be specified when using raw_input_contents for '{name}' for "
                    f"model '{req.model_name}'"
                )
            if used_raw == n_raw:
                raise InvalidArgument(
                    f"unable to find data for input tensor '{name}' for model '{req.model_name}' in request."
                )
            inputs[name] = tensors.from_buffer(datatype, raw[used_raw], shape)
            used_raw += 1
        else:
            field = _CONTENTS.get(datatype)
            if field is None:
                raise InvalidArgument(
                    f"input '{name}': datatype {datatype} must be sent in raw_input_contents"
                )
            values = getattr(t.contents, field)
            count = tensors.element_count(shape)
            if count and not t.HasField("contents"):
                raise InvalidArgument(
                    f"unable to find data for input tensor '{name}' for model '{req.model_name}' in request."
                )
            if len(values) != count:
                raise InvalidArgument(
                    f"unexpected number of elements {len(values)} in the contents of input '{name}', "
                    f"expecting {count} for shape {shape}"
                )
            if datatype == "BYTES":
                arr = np.empty(count, dtype=np.object_)
                arr[:] = list(values)
            else:
                arr = np.asarray(values, dtype=tensors.numpy_dtype(datatype))
            inputs[name] = arr.reshape(shape)
        datatypes[name] = datatype
    if used_raw != n_raw:
        raise InvalidArgument(
            f"expected {used_raw} raw_input_contents entries (one per input not in shared memory), got {n_raw}"
        )
    # (protobuf containers cost ~2 us to iterate even when empty: look before iterating)
    params = {k: param_value(v) for k, v in req.parameters.items()} if req.parameters else {}
    outputs = []
    for o in req.outputs if len(req.outputs) else ():
        oparams = {k: param_value(v) for k, v in o.parameters.items()} if o.parameters else {}
        outputs.append(
            RequestedOutput(
                o.name, binary=True, classification=int(oparams.get("classification", 0)), parameters=oparams
            )
        )
    request = InferenceRequest(
        model_name=req.model_name,
        inputs=inputs,
        datatypes=datatypes,
        model_version=parse_version(req.model_version),
        id=req.id,
        outputs=outputs,
        parameters=params,
    )
    request_options(request, params)
    return request


def _traceparent(context) -> str | None:
    """The W3C traceparent a client sent in the call's metadata (read only while tracing)."""
    return next((v for k, v in context.invocation_metadata() or () if k == "traceparent"), None)


def _set_param(p, value) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def encode_response(
    resp: InferenceResponse, request: InferenceRequest | None, shm=None, chunked: bool = False
) -> pb.ModelInferResponse:
    """InferenceResponse -> ModelInferResponse; `chunked`: a grpc_wire.ChunkedResponse whose raw contents are
    the output tensors' own memory (h2grpc sends it without joining)."""
    out = pb.ModelInferResponse(model_name=resp.model_name, model_version=resp.model_version, id=resp.id)
    for k, v in resp.parameters.items():
        _set_param(out.parameters[k], v)
    wanted = {o.name: o for o in request.outputs} if request is not None else {}
    raws = []
    for t in resp.outputs:
        out.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        req = wanted.get(t.name)
        if req is not None and "shared_memory_region" in req.parameters:
            if shm is None:
                raise InvalidArgument("shared memory is not enabled on this server")
            shm.write_output(t, req.parameters)
            # Triton sends one raw_output_contents entry per output, an empty one for an output in shared
            # memory; C++ clients (perf_analyzer) index raw_output_contents by output position.
            raws.append(b"")
            continue
        raws.append(tensors.to_bytes(t.data, t.datatype))
    if chunked and sum(len(r) for r in raws) >= grpc_wire.SPLIT_MIN:
        return grpc_wire.ChunkedResponse(out, raws)
    if raws:
        out.raw_output_contents.extend(bytes(r) for r in raws)
    return out


class _Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, server: Server, shm=None, logging_ext=None, trace_ext=None):
        self.server = server
        self.shm = shm
        self.logging_ext = logging_ext
        self.trace_ext = trace_ext

    async def _fail(self, context, exc: BaseException):
        err = as_naiad_error(exc)
        code, message = err.grpc_status, err.message
        # the traceback holds the frames, and with them the request: drop it now, not at the next full GC
        exc.__traceback__ = err.__traceback__ = None
        del err, exc
        await context.abort(code, message)

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.server.live())

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.server.ready())

    async def ModelReady(self, request, context):
        try:
            return pb.ModelReadyResponse(ready=self.server.model_ready(request.name, request.version))
        except NaiadError as exc:
            await self._fail(context, exc)

    async def ServerMetadata(self, request, context):
        md = self.server.metadata()
        return pb.ServerMetadataResponse(name=md["name"], version=md["version"], extensions=md["extensions"])

    async def ModelMetadata(self, request, context):
        try:
            md = self.server.model_metadata(request.name, request.version)
        except NaiadError as exc:
            return await self._fail(context, exc)
        resp = pb.ModelMetadataResponse(name=md["name"], versions=md["versions"], platform=md["platform"])
        for kind in ("inputs", "outputs"):
            for t in md[kind]:
                getattr(resp, kind).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return resp

    async def ModelConfig(self, request, context):
        try:
            mv = self.server.model(request.name, request.version)
        except NaiadError as exc:
            return await self._fail(context, exc)
        return pb.ModelConfigResponse(config=mv.config)

    async def ModelStatistics(self, request, context):
        try:
            stats = self.server.model_statistics(request.name, request.version)
        except NaiadError as exc:
            return await self._fail(context, exc)
        resp = pb.ModelStatisticsResponse()
        for s in stats:
            json_format.ParseDict(s, resp.model_stats.add(), ignore_unknown_fields=True)
        return resp

    async def RepositoryIndex(self, request, context):
        resp = pb.RepositoryIndexResponse()
        await self.server.repository.refresh()
        for e in self.server.repository.index(request.ready):
            resp.models.add(
                name=e["name"],
                version=e.get("version", ""),
                state=e.get("state", ""),
                reason=e.get("reason", ""),
            )
        return resp

    async def RepositoryModelLoad(self, request, context):
        params = {k: param_value(v) for k, v in request.parameters.items()}
        files = {k[len("file:") :]: v for k, v in params.items() if k.startswith("file:")}
        try:
            await self.server.load_model(request.model_name, params.get("config") or None, files or None)
        except NaiadError as exc:
            return await self._fail(context, exc)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        params = {k: param_value(v) for k, v in request.parameters.items()}
        try:
            await self.server.unload_model(request.model_name, bool(params.get("unload_dependents")))
        except NaiadError as exc:
            return await self._fail(context, exc)
        return pb.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request, context):
        try:
            if type(request) is grpc_wire.SplitInferRequest:  # Naiad's own HTTP/2 server
                req = decode_request(request.message, self.shm, request.raw)
                chunked = True
            else:
                req = decode_request(request, self.shm)
                chunked = False
            req.traceparent = _traceparent(context) if self.server.tracer.active else None
            resp = await self.server.infer(req)
            return encode_response(resp, req, self.shm, chunked)
        except NaiadError as exc:
            return await self._fail(context, exc)
        except Exception as exc:
            log.exception("ModelInfer failed")
            return await self._fail(context, exc)

    async def ModelStreamInfer(self, request_iterator, context):
        """Bidirectional stream: requests run concurrently; errors go in `error_message`, never abort."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()

        async def handle(msg: pb.ModelInferRequest) -> None:
            req = None
            try:
                req = decode_request(msg, self.shm)
                req.traceparent = _traceparent(context) if self.server.tracer.active else None
                empty_final = bool(req.parameters.get("triton_enable_empty_final_response", False))
                mv = self.server.repository.get(req.model_name, req.model_version)
                if not mv.decoupled:
                    resp = await self.server.infer(req)
                    queue.put_nowait(
                        pb.ModelStreamInferResponse(infer_response=encode_response(resp, req, self.shm))
                    )
                    return
                async for resp in self.server.infer_stream(req):
                    if resp.error is not None:
                        queue.put_nowait(pb.ModelStreamInferResponse(error_message=str(resp.error)))
                        if resp.final:
                            break
                        continue
                    if not resp.outputs and resp.final and not empty_final:
                        break
                    out = encode_response(resp, req, self.shm)
                    out.parameters["triton_final_response"].bool_param = resp.final
                    queue.put_nowait(pb.ModelStreamInferResponse(infer_response=out))
            except Exception as exc:
                err = as_naiad_error(exc)
                message = err.message
                exc.__traceback__ = err.__traceback__ = None  # it holds this frame and `msg` (the request)
                del err
                queue.put_nowait(
                    pb.ModelStreamInferResponse(
                        error_message=message,
                        infer_response=pb.ModelInferResponse(
                            model_name=msg.model_name, model_version=msg.model_version, id=msg.id
                        ),
                    )
                )

        async def reader() -> None:
            try:
                async for msg in request_iterator:
                    task = loop.create_task(handle(msg))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                while tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
                queue.put_nowait(None)

        read_task = loop.create_task(reader())
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                yield item
        finally:
            read_task.cancel()
            for t in list(tasks):
                t.cancel()

    # Shared memory, logging and trace are served by their extension objects when present.
    async def SystemSharedMemoryStatus(self, request, context):
        return await self._ext(context, self.shm, shm_handlers.system_status_grpc, request)

    async def SystemSharedMemoryRegister(self, request, context):
        return await self._ext(context, self.shm, shm_handlers.system_register_grpc, request)

    async def SystemSharedMemoryUnregister(self, request, context):
        return await self._ext(context, self.shm, shm_handlers.system_unregister_grpc, request)

    async def LogSettings(self, request, context):
        return await self._ext(context, self.logging_ext, "grpc", request)

    async def TraceSetting(self, request, context):
        if request.model_name and request.model_name not in self.server.repository.records:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"Request for unknown model : {request.model_name}"
            )
        return await self._ext(context, self.trace_ext, "grpc", request)

    async def CudaSharedMemoryStatus(self, request, context):
        if (
            getattr(self.shm, "cuda", None) is not None
        ):  # a GPU is present: naiad.shared_memory.cuda serves it
            return await self._ext(context, self.shm.cuda, shm_handlers.cuda_status_grpc, request)
        if request.name:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"Unable to find cuda shared memory region: '{request.name}'"
            )
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        if (
            getattr(self.shm, "cuda", None) is not None
        ):  # a GPU is present: naiad.shared_memory.cuda serves it
            return await self._ext(context, self.shm.cuda, shm_handlers.cuda_register_grpc, request)
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "CUDA shared memory is not supported by this server: it needs a CUDA device",
        )

    async def CudaSharedMemoryUnregister(self, request, context):
        if (
            getattr(self.shm, "cuda", None) is not None
        ):  # a GPU is present: naiad.shared_memory.cuda serves it
            return await self._ext(context, self.shm.cuda, shm_handlers.cuda_unregister_grpc, request)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def _ext(self, context, ext, method, request):
        if ext is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this extension is not enabled on this server")
        try:
            # a handler function of the extension's manager, or the name of the extension object's method
            return method(ext, request) if callable(method) else getattr(ext, method)(request)
        except NaiadError as exc:
            return await self._fail(context, exc)


_GROUPS = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


def api_group(method: str) -> str | None:
    """The restricted-protocol group of a GRPCInferenceService method name."""
    return "shared-memory" if "SharedMemory" in method else _GROUPS.get(method)


def _same(given: str | bytes, expected: str) -> bool:
    """Constant-time comparison of a credential."""
    given = given if isinstance(given, bytes) else given.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, expected.encode("utf-8", "surrogateescape"))


def _denial(rules: dict[str, tuple[str, str]], group: str | None, metadata) -> str | None:
    rule = rules.get(group)
    if rule is None:
        return None
    key, value = rule
    if any(k == key and _same(v, value) for k, v in metadata):
        return None
    return f"This API is restricted, expecting header '{key}'"


class _Health:
    """grpc.health.v1.Health for the HTTP/2 frontend: Check, and Watch as a stream of status changes."""

    def __init__(self):
        from grpc_health.v1 import health_pb2

        self.pb = health_pb2
        self.status: dict[str, int] = {}
        self.changed = asyncio.Event()

    def set(self, service: str, status: int) -> None:
        self.status[service] = status
        self.changed.set()
        self.changed = asyncio.Event()

    async def Check(self, request, context):
        status = self.status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return self.pb.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        last = None
        while True:
            status = self.status.get(request.service, self.pb.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                last = status
                yield self.pb.HealthCheckResponse(status=status)
            await self.changed.wait()


class _Restrict(grpc.aio.ServerInterceptor):
    """--grpc-restricted-protocol: calls of a restricted group need the configured metadata key/value."""

    def __init__(self, rules: dict[str, tuple[str, str]]):
        self.rules = rules

    async def intercept_service(self, continuation, details):
        method = details.method.rsplit("/", 1)[-1]
        message = _denial(self.rules, api_group(method), details.invocation_metadata or ())
        if message is None:
            return await continuation(details)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

        async def deny_stream(request_iterator, context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
            yield  # pragma: no cover - abort raises

        if method == "ModelStreamInfer":
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)


_SERVING_NAMES = ("", "inference.GRPCInferenceService")


def grpcio_options(settings) -> list[tuple[str, int]]:
    """grpc.aio server options (channel arguments) for the same limits and timers as h2_connection.H2Settings."""
    from .h2grpc_messages import MAX_MESSAGE

    s = settings
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_receive_message_length", s.max_message),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", s.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", s.keepalive_timeout_ms),
        ("grpc.http2.ping_timeout_ms", s.keepalive_timeout_ms),  # grpc core's own PING watchdog (1 min)
        ("grpc.keepalive_permit_without_calls", int(s.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", s.http2_max_pings_without_data),
        ("grpc.http2.min_ping_interval_without_data_ms", s.http2_min_recv_ping_interval_without_data_ms),
        ("grpc.http2.max_ping_strikes", s.http2_max_ping_strikes),
    ]
    if s.max_concurrent_streams:
        options.append(("grpc.max_concurrent_streams", s.max_concurrent_streams))
    if s.max_connection_idle_ms:
        options.append(("grpc.max_connection_idle_ms", s.max_connection_idle_ms))
    if s.handshake_timeout_ms:
        options.append(("grpc.server_handshake_timeout_ms", s.handshake_timeout_ms))
    return options


def h2_settings(args):
    """H2Settings from `naiad serve`'s --grpc-* flags (absent flags keep their defaults)."""
    from .h2_connection import H2Settings

    names = {
        "max_concurrent_streams": "grpc_max_concurrent_streams",
        "max_message": "grpc_max_message_size",
        "keepalive_time_ms": "grpc_keepalive_time",
        "keepalive_timeout_ms": "grpc_keepalive_timeout",
        "keepalive_permit_without_calls": "grpc_keepalive_permit_without_calls",
        "http2_max_pings_without_data": "grpc_http2_max_pings_without_data",
        "http2_min_recv_ping_interval_without_data_ms": "grpc_http2_min_recv_ping_interval_without_data",
        "http2_max_ping_strikes": "grpc_http2_max_ping_strikes",
        "handshake_timeout_ms": "grpc_handshake_timeout",
        "max_connection_idle_ms": "grpc_max_connection_idle",
        "stall_timeout_ms": "grpc_stall_timeout",
    }
    given = {
        field: getattr(args, flag) for field, flag in names.items() if getattr(args, flag, None) is not None
    }
    return H2Settings(**given)


class GrpcFrontend:
    """`implementation`: "naiad" (our HTTP/2 server, h2grpc.py) or "grpcio" (grpc.aio)."""

    def __init__(
        self,
        server: Server,
        shm=None,
        restricted: dict | None = None,
        implementation: str = "naiad",
        settings=None,
    ):
        from .h2_connection import H2Settings

        self.settings = settings or H2Settings()
        self.server = server
        self.servicer = _Servicer(server, shm, server.log_settings, server.tracer)
        self.restricted = restricted or {}
        self.implementation = implementation
        self._grpc = None
        self._health = None
        self._tls_context = None

    async def start(self, host: str, port: int, tls_settings=None) -> None:
        """`tls_settings` (tls.TlsSettings): serve over TLS, reloading the certificate when its files change."""
        if self.implementation == "grpcio":
            await self._start_grpcio(host, port, tls_settings)
        else:
            await self._start_h2(host, port, tls_settings)

    async def _start_h2(self, host: str, port: int, tls_settings=None) -> None:
        from . import h2grpc

        methods = h2grpc.service_methods(
            pb.DESCRIPTOR.services_by_name["GRPCInferenceService"],
            self.servicer,
            api_group,
            request_types={"ModelInfer": grpc_wire.SplitInferRequest},
        )
        try:
            from grpc_health.v1 import health_pb2

            self._health = _Health()
            methods.update(
                h2grpc.service_methods(health_pb2.DESCRIPTOR.services_by_name["Health"], self._health)
            )
        except ImportError:
            log.warning("grpcio-health-checking is not installed: grpc.health.v1 is not served")
        authorize = None
        if self.restricted:
            rules = self.restricted

            def authorize(method, metadata):
                return _denial(
                    rules, method.group, ((k.decode("latin-1"), v.decode("latin-1")) for k, v in metadata)
                )

        self._grpc = h2grpc.H2GrpcServer(methods, authorize, self.settings)
        context = None
        if tls_settings is not None:
            self._tls_context = tls.ReloadingContext(tls_settings, ["h2"], "gRPC")
            context = self._tls_context.context
        try:
            await self._grpc.start(host, port, ssl=context)
        except OSError as exc:
            raise OSError(f"cannot bind gRPC to {host}:{port}: {exc}") from exc
        if self._tls_context is not None:
            self._tls_context.start()
        await self._set_health("SERVING")

    async def _set_health(self, status: str) -> None:
        if self._health is None:
            return
        from grpc_health.v1 import health_pb2

        value = health_pb2.HealthCheckResponse.ServingStatus.Value(status)
        for svc in _SERVING_NAMES:
            result = self._health.set(svc, value)
            if asyncio.iscoroutine(result):
                await result

    async def _start_grpcio(self, host: str, port: int, tls_settings=None) -> None:
        options = grpcio_options(self.settings)
        interceptors = [_Restrict(self.restricted)] if self.restricted else []
        self._grpc = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, self._grpc)
        try:
            from grpc_health.v1 import health, health_pb2_grpc

            self._health = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        except ImportError:
            log.warning("grpcio-health-checking is not installed: grpc.health.v1 is not served")
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if tls_settings is not None:
            bound = self._grpc.add_secure_port(addr, tls.grpcio_credentials(tls_settings))
        else:
            bound = self._grpc.add_insecure_port(addr)
        if bound == 0:
            raise OSError(f"cannot bind gRPC to {addr}")
        await self._grpc.start()
        await self._set_health("SERVING")

    async def stop(self, grace: float) -> None:
        await self._set_health("NOT_SERVING")
        if self._tls_context is not None:
            self._tls_context.close()
        if self._grpc is not None:
            await self._grpc.stop(grace)
