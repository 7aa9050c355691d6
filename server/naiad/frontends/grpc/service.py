"""The gRPC services' handlers: GRPCInferenceService (KServe v2 with Triton's extensions) over the serving API
(`serving.Serving`), and grpc.health.v1.Health for Naiad's HTTP/2 server. Shared by both implementations (server.py
and grpc.aio)."""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from ...errors import NaiadError, Unsupported, as_naiad_error
from ...orchestration.on_demand import LOAD_WAIT_PARAMETER
from ...serving import Serving
from ..triton import shm as shm_handlers
from . import wire
from .codec import decode_request, encode_response, load_parameters, unload_dependents

log = logging.getLogger("naiad.grpc")


def _traceparent(context) -> str | None:
    """The W3C traceparent a client sent in the call's metadata (read only while tracing)."""
    return next((v for k, v in context.invocation_metadata() or () if k == "traceparent"), None)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """GRPCInferenceService: each RPC a thin adapter over the serving API (`serving.Serving`)."""

    def __init__(self, server: Serving, shm=None, logging_ext=None, trace_ext=None):
        self.server = server
        self.shm = shm
        self.logging_ext = logging_ext
        self.trace_ext = trace_ext

    async def _fail(self, context, exc: BaseException):
        err = as_naiad_error(exc)
        code, message = err.grpc_status, err.message
        metadata = () if err.retry_after is None else (("retry-after", str(max(1, round(err.retry_after)))),)
        # the traceback holds the frames, and with them the request: drop it now, not at the next full GC
        exc.__traceback__ = err.__traceback__ = None
        del err, exc
        if metadata:
            await context.abort(code, message, metadata)
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
        if request.repository_name:
            return await self._fail(context, Unsupported("'repository_name' specification is not supported"))
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
        try:
            config, files = load_parameters(request.parameters)
            await self.server.load_model(request.model_name, config, files or None)
        except NaiadError as exc:
            return await self._fail(context, exc)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        try:
            await self.server.unload_model(request.model_name, unload_dependents(request.parameters))
        except NaiadError as exc:
            return await self._fail(context, exc)
        return pb.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request, context):
        try:
            if type(request) is wire.SplitInferRequest:  # Naiad's own HTTP/2 server
                req = decode_request(request.message, self.shm, request.raw, request.packed)
                chunked = True
            else:
                req = decode_request(request, self.shm)
                chunked = False
            req.traceparent = _traceparent(context) if self.server.tracer.active else None
            resp = await self.server.infer(req)
            if req.load_wait_ns:
                resp.parameters[LOAD_WAIT_PARAMETER] = round(req.load_wait_ns / 1e6, 1)
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

        async def handle(msg: pb.ModelInferRequest | wire.SplitInferRequest) -> None:
            req = None
            # Naiad's own HTTP/2 server: raw contents stay views of the message, outputs are sent from their memory
            chunked = type(msg) is wire.SplitInferRequest
            head: pb.ModelInferRequest = msg.message if chunked else msg
            try:
                req = decode_request(
                    head, self.shm, msg.raw if chunked else None, msg.packed if chunked else None
                )
                req.traceparent = _traceparent(context) if self.server.tracer.active else None
                empty_final = bool(req.parameters.get("triton_enable_empty_final_response", False))
                mv, req.load_wait_ns = await self.server.ready_model(req.model_name, req.model_version)
                if not mv.decoupled:
                    resp = await self.server.infer(req)
                    if req.load_wait_ns:
                        resp.parameters[LOAD_WAIT_PARAMETER] = round(req.load_wait_ns / 1e6, 1)
                    queue.put_nowait(wire.stream_response(encode_response(resp, req, self.shm, chunked)))
                    return
                async for resp in self.server.infer_stream(req):
                    if resp.error is not None:
                        queue.put_nowait(pb.ModelStreamInferResponse(error_message=str(resp.error)))
                        if resp.final:
                            break
                        continue
                    if not resp.outputs and resp.final and not empty_final:
                        break
                    out = encode_response(resp, req, self.shm, chunked)
                    message = out.message if type(out) is wire.ChunkedResponse else out
                    message.parameters["triton_final_response"].bool_param = resp.final
                    queue.put_nowait(wire.stream_response(out))
            except Exception as exc:
                err = as_naiad_error(exc)
                message = err.message
                exc.__traceback__ = err.__traceback__ = None  # it holds this frame and `msg` (the request)
                del err
                queue.put_nowait(
                    pb.ModelStreamInferResponse(
                        error_message=message,
                        infer_response=pb.ModelInferResponse(
                            model_name=head.model_name, model_version=head.model_version, id=head.id
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


class HealthServicer:
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
