"""KServe v2 HTTP/REST frontend (aiohttp) with Triton's extensions. A thin adapter over the serving API
(`serving.Serving`: `Server`, or a frontend worker's `EngineClient`)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os

import orjson
from aiohttp import web

from ... import config as cfg
from ... import tensors
from ...errors import InvalidArgument, NaiadError, NotFound
from ...inference import InferenceRequest
from ...repository import decode_file_overrides
from ...serving import Serving
from ..transport import drain
from ..transport.busy_poll import BusyPoll
from ..transport.receive_buffers import POOLED_MIN
from ..triton import shm as shm_handlers
from ..triton.parameters import boolean, parameters_of
from . import generate
from .aiohttp_site import start_tcp_site
from .codec import (
    HEADER_LENGTH,
    compress_response,
    decode_infer_request,
    encode_infer_response,
    error_headers,
    error_payload,
    load_wait_header,
    model_version,
    read_body,
    read_tensor_body,
    response_coding,
    restricted_message,
)
from .fast import FastHttpServer
from .sse import EventStream

log = logging.getLogger("naiad.http")


def _json(data, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(exc: BaseException) -> web.Response:
    status, body = error_payload(exc)
    headers = error_headers(exc)
    if headers is not None:
        return web.Response(body=body, status=status, headers=headers)
    return web.Response(body=body, status=status, content_type="application/json")


# ---- the app ----


def api_category(path: str) -> str:
    """Triton's restricted-API groups for an HTTP path (and Naiad's `openai` group for the OpenAI API)."""
    parts = path.strip("/").split("/")
    if parts[0] == "v1":
        return "openai"
    if len(parts) < 2:
        return "metadata"
    head = parts[1]
    if head == "health":
        return "health"
    if head in ("systemsharedmemory", "cudasharedmemory"):
        return "shared-memory"
    if head == "repository":
        return "model-repository"
    if head == "logging":
        return "logging"
    if head == "trace" or parts[-2:] == ["trace", "setting"]:
        return "trace"
    last = parts[-1]
    if last == "stats":
        return "statistics"
    if last == "config":
        return "model-config"
    if last in ("infer", "generate", "generate_stream"):
        return "inference"
    return "metadata"


class HttpFrontend:
    def __init__(
        self,
        server: Serving,
        shm=None,
        max_input_size: int = 64 * 1024 * 1024,
        restricted: dict | None = None,
        busy_poll: BusyPoll | None = None,
        openai=None,
    ):
        """`openai`: an openai.routes.OpenAIFrontend whose /v1 routes this app serves too (its `http_error` and
        `restricted` answer a /v1 path's errors and restricted-API refusals with OpenAI's error object)."""
        self.server = server
        self.openai = openai
        self.busy_poll = busy_poll
        self.shm = shm
        self.restricted = restricted or {}
        self.max_input_size = max_input_size
        middlewares = [self._errors]
        if self.restricted:
            middlewares.append(self._restrict)
        self.app = web.Application(client_max_size=max_input_size, middlewares=middlewares)
        drain.install(self.app)  # on SIGTERM, answers close their keep-alive connections
        r = self.app.router
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_get("/v2", self.metadata)
        r.add_get("/v2/models/stats", self.stats)
        r.add_post("/v2/repository/index", self.index)
        r.add_post("/v2/repository/models/{model}/load", self.load)
        r.add_post("/v2/repository/models/{model}/unload", self.unload)
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(prefix, self.model_metadata)
            r.add_get(prefix + "/ready", self.model_ready)
            r.add_get(prefix + "/config", self.model_config)
            r.add_get(prefix + "/stats", self.stats)
            r.add_post(prefix + "/infer", self.infer)
            r.add_post(prefix + "/generate", self.generate)
            r.add_post(prefix + "/generate_stream", self.generate_stream)
            r.add_get(prefix + "/trace/setting", self.trace_setting)
            r.add_post(prefix + "/trace/setting", self.trace_setting)
        r.add_get("/v2/trace/setting", self.trace_setting)
        r.add_post("/v2/trace/setting", self.trace_setting)
        r.add_get("/v2/logging", self.logging)
        r.add_post("/v2/logging", self.logging)
        r.add_get("/v2/systemsharedmemory/status", self.shm_status)
        r.add_get("/v2/systemsharedmemory/region/{region}/status", self.shm_status)
        r.add_post("/v2/systemsharedmemory/region/{region}/register", self.shm_register)
        r.add_post("/v2/systemsharedmemory/region/{region}/unregister", self.shm_unregister)
        r.add_post("/v2/systemsharedmemory/unregister", self.shm_unregister)
        r.add_get("/v2/cudasharedmemory/status", self.cuda_shm)
        r.add_get("/v2/cudasharedmemory/region/{region}/status", self.cuda_shm)
        r.add_post("/v2/cudasharedmemory/region/{region}/register", self.cuda_shm)
        r.add_post("/v2/cudasharedmemory/region/{region}/unregister", self.cuda_shm)
        r.add_post("/v2/cudasharedmemory/unregister", self.cuda_shm)
        if openai is not None:
            openai.add_routes(r)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status >= 400:
                if self.openai is not None and request.path.startswith("/v1/"):
                    # the OpenAI API answers with OpenAI's error object
                    return self.openai.http_error(request, exc)
                return _json({"error": exc.reason or exc.text or "error"}, status=exc.status)
            raise
        except NaiadError as exc:
            return error_response(exc)
        except Exception as exc:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(exc)

    @web.middleware
    async def _restrict(self, request: web.Request, handler):
        category = api_category(request.path)
        rule = self.restricted.get(category)
        if rule is not None:
            key, value = rule
            given = request.headers.get(key)
            if given is None or not hmac.compare_digest(
                given.encode("utf-8", "surrogateescape"), value.encode("utf-8", "surrogateescape")
            ):
                if category == "openai" and self.openai is not None:
                    return self.openai.restricted(key)
                return _json({"error": restricted_message(key)}, status=403)
        return await handler(request)

    # health & metadata
    async def live(self, request):
        return web.Response(status=200 if self.server.live() else 400)

    async def ready(self, request):
        return web.Response(status=200 if self.server.ready() else 400)

    async def metadata(self, request):
        return _json(self.server.metadata())

    async def model_metadata(self, request):
        m = request.match_info
        return _json(self.server.model_metadata(m["model"], model_version(m.get("version", ""))))

    async def model_ready(self, request):
        m = request.match_info
        if self.server.model_ready(m["model"], model_version(m.get("version", ""))):
            return web.Response(status=200)
        return _json({"error": "Model version not ready"}, status=400)

    async def model_config(self, request):
        m = request.match_info
        mv = self.server.model(m["model"], model_version(m.get("version", "")))
        return _json(cfg.to_dict(mv.config))

    async def stats(self, request):
        m = request.match_info
        version = model_version(m.get("version", ""))
        return _json({"model_stats": self.server.model_statistics(m.get("model", ""), version)})

    # repository extension
    async def _body_json(self, request) -> dict:
        body = await read_body(request, self.max_input_size)
        if not body:
            return {}
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"failed to parse the request JSON buffer: {exc}") from None
        if not isinstance(doc, dict):
            raise InvalidArgument("the request body must be a JSON object")
        return doc

    async def index(self, request):
        doc = await self._body_json(request)
        await self.server.repository.refresh()
        ready = boolean(doc["ready"], "ready") if "ready" in doc else False
        memory = (boolean(doc["memory"], "memory") if "memory" in doc else False) or self.server.orchestrated
        return _json(self.server.repository.index(ready, memory))

    async def load(self, request):
        doc = await self._body_json(request)
        params = parameters_of(doc)
        for key in params:  # (Triton's HTTP answers another key with 500; these are its gRPC words)
            if key != "config" and not key.startswith("file:"):
                raise InvalidArgument(f"unrecognized load parameter '{key}'.")
        config = params.get("config")
        if config is not None and not isinstance(config, (str, dict)):
            raise InvalidArgument("the 'config' parameter must be a JSON string")
        files = decode_file_overrides(params)
        await self.server.load_model(request.match_info["model"], config, files or None)
        return web.Response(status=200)

    async def unload(self, request):
        doc = await self._body_json(request)
        params = parameters_of(doc)
        await self.server.unload_model(request.match_info["model"], bool(params.get("unload_dependents")))
        return web.Response(status=200)

    # logging, trace
    async def logging(self, request):
        if request.method == "POST":
            return _json(self.server.log_settings.update(await self._body_json(request)))
        return _json(self.server.log_settings.get())

    async def trace_setting(self, request):
        model = request.match_info.get("model", "")
        if model and model not in self.server.repository.records:
            raise InvalidArgument(f"Request for unknown model : {model}")
        if request.method == "POST":
            return _json(self.server.tracer.update(await self._body_json(request), model))
        return _json(self.server.tracer.get(model))

    # shared memory
    def _shm(self):
        if self.shm is None or not self.shm.enabled:
            raise InvalidArgument("shared memory support is disabled on this server (--allow-client-shm)")
        return self.shm

    async def shm_status(self, request):
        return _json(self._shm().status(request.match_info.get("region", "")))

    async def shm_register(self, request):
        doc = await self._body_json(request)
        self._shm().register(
            request.match_info["region"], doc.get("key"), doc.get("offset", 0), doc.get("byte_size", 0)
        )
        return web.Response(status=200)

    async def shm_unregister(self, request):
        self._shm().unregister(request.match_info.get("region", ""))
        return web.Response(status=200)

    async def cuda_shm(self, request):
        """No CUDA device: nothing is ever registered, so status lists no regions and unregister succeeds (as
        Triton answers on a host without a GPU, and as the gRPC path does); registration is refused clearly."""
        if getattr(self.shm, "cuda", None) is not None:  # a GPU is present: CUDA shared memory is served
            return await shm_handlers.cuda_http(self.shm.cuda, request)
        if request.method == "GET":
            if request.match_info.get("region"):
                raise NotFound(f"Unable to find cuda shared memory region: '{request.match_info['region']}'")
            return _json([])
        if request.path.endswith("/unregister"):
            return web.Response(status=200, content_type="application/json")
        raise InvalidArgument("CUDA shared memory is not supported by this server: it needs a CUDA device")

    # inference
    def _raw_binary_request(self, mv, model: str, v: int, body: bytes | memoryview) -> InferenceRequest:
        """Triton's raw binary request (no JSON header): the whole body is the only input's tensor."""
        if len(mv.inputs) != 1:
            raise InvalidArgument(
                f"a raw binary request (no JSON header) needs a model with exactly one input; "
                f"model '{model}' has {len(mv.inputs)}"
            )
        spec = next(iter(mv.inputs.values()))
        batch = [1] if mv.max_batch_size > 0 else []
        if spec.datatype == "BYTES":
            data = tensors.deserialize_bytes(body)
            arr = data.reshape(batch + [len(data)])
        else:
            size = tensors.ITEMSIZE[spec.datatype]
            if len(body) % size:
                raise InvalidArgument(
                    f"raw binary request of {len(body)} bytes is not a whole number of "
                    f"{spec.datatype} elements"
                )
            fixed = all(d > 0 for d in spec.dims) and len(spec.dims) > 1
            shape = batch + (list(spec.dims) if fixed else [len(body) // size])
            arr = tensors.from_buffer(spec.datatype, body, shape)
        return InferenceRequest(
            model_name=model, inputs={spec.name: arr}, datatypes={spec.name: spec.datatype}, model_version=v
        )

    async def run_infer(
        self,
        model: str,
        version: str,
        body: bytes | memoryview,
        header_length: str | None,
        traceparent: str | None = None,
    ) -> tuple[list, dict]:
        """One infer request from its route and body to the response's (body chunks, headers).

        The one implementation behind the aiohttp route and the fast HTTP/1.1 path (fast.py)."""
        if header_length == "0" or (header_length is None and not body):
            v = model_version(version)
            mv, waited = await self.server.ready_model(model, v)
            req, default_binary = self._raw_binary_request(mv, model, v, body), True
            req.load_wait_ns = waited
        else:
            req, default_binary = decode_infer_request(model, version, body, header_length, self.shm)
        req.traceparent = traceparent
        response = await self.server.infer(req)
        if req.load_wait_ns:  # (the one check the loaded model's path pays)
            chunks, headers = encode_infer_response(response, req, default_binary, self.shm)
            load_wait_header(req, headers)
            return chunks, headers
        return encode_infer_response(response, req, default_binary, self.shm)

    async def infer(self, request: web.Request):
        m = request.match_info
        body = await read_tensor_body(request, self.max_input_size)
        trace = request.headers.get("traceparent") if self.server.tracer.active else None
        chunks, headers = await self.run_infer(
            m["model"], m.get("version", ""), body, request.headers.get(HEADER_LENGTH), trace
        )
        coding = response_coding(request.headers.get("Accept-Encoding", ""))
        if coding is not None:
            chunks, headers = await compress_response(asyncio.get_running_loop(), chunks, headers, coding)
        if len(chunks) == 1:
            return web.Response(body=chunks[0], headers=headers)
        size = sum(len(c) for c in chunks)
        if size < POOLED_MIN:
            return web.Response(body=b"".join(chunks), headers=headers)
        # a large response is written from its buffers (the output tensors' memory), not joined into a copy
        response = web.StreamResponse(headers=headers)
        response.content_length = size
        await response.prepare(request)
        for chunk in chunks:
            await response.write(chunk)
        await response.write_eof()
        return response

    # generate extension
    async def _generate_request(self, request):
        m = request.match_info
        version = model_version(m.get("version", ""))
        mv, waited = await self.server.ready_model(m["model"], version)
        body = await read_body(request, self.max_input_size)
        req = generate.decode(mv, generate.parse(body), version)
        req.load_wait_ns = waited
        return mv, req

    async def generate(self, request):
        mv, req = await self._generate_request(request)
        responses = []
        async for resp in self.server.infer_stream(req):
            if resp.error is not None:
                raise resp.error if isinstance(resp.error, NaiadError) else InvalidArgument(str(resp.error))
            if resp.outputs or resp.parameters or not resp.final or not mv.decoupled:
                responses.append(resp)  # (a decoupled model's final flag alone is no response)
        if len(responses) != 1:
            raise InvalidArgument(generate.EXACTLY_ONE)
        out = _json(generate.encode(responses[0]))
        if req.load_wait_ns:
            load_wait_header(req, out.headers)
        return out

    async def generate_stream(self, request):
        """Server-Sent Events, one `data: {...}` event per response and no end marker, as Triton sends them. The
        first response sets the status (an error first: its status, with the error as the event); an error after
        it is an event under the 200. An error before any response is a plain JSON error."""
        _, req = await self._generate_request(request)
        events = EventStream(request)  # no stall timeout: written as aiohttp writes, as Triton's stream is
        if req.load_wait_ns:
            load_wait_header(req, events.response.headers)
        responses = self.server.infer_stream(req)
        try:
            async for resp in responses:
                if resp.error is None and not resp.outputs and not resp.parameters and resp.final:
                    continue  # the final flag alone: nothing to send
                if not events.started:
                    if resp.error is not None:
                        events.response.set_status(error_payload(resp.error)[0])
                    await events.start()
                event = {"error": str(resp.error)} if resp.error is not None else generate.encode(resp)
                if resp.more_ready:  # the next response is already waiting: it goes out with it, in one write
                    events.hold(event)
                else:
                    await events.send(event)
        except NaiadError as exc:
            if not events.started:
                raise
            events.hold({"error": exc.message})
        except ConnectionResetError:  # the client went away mid-stream: nobody to answer, nothing to log
            return events.response
        finally:
            await responses.aclose()  # a client that went away cancels the request
        try:
            return await events.end()
        except ConnectionResetError:
            return events.response

    async def start(
        self, host: str, port: int, ssl=None, reuse_port: bool = False, listen: bool = True
    ) -> HttpListener | web.AppRunner:
        """Listen with the fast HTTP/1.1 protocol (fast.py); it hands the aiohttp app every connection
        that sends anything but a plain infer request. `cleanup()` on the result stops both.
        NAIAD_HTTP_FAST=0 in the environment serves everything with aiohttp alone, as before.
        `ssl`: an ssl.SSLContext to serve HTTPS (both paths see the decrypted stream). `reuse_port`:
        SO_REUSEPORT, so that every frontend worker process listens on the port. `listen=False`: bind nothing; the
        engine's acceptor hands this worker its connections (`protocol_factory(result)`)."""
        # bodies are inflated by read_body (bounded, off the event loop), not by aiohttp
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False, auto_decompress=False)
        await runner.setup()
        if os.environ.get("NAIAD_HTTP_FAST", "1") == "0":  # escape hatch (and A/B benchmarks): aiohttp only
            if listen:
                await start_tcp_site(runner, host, port, ssl, reuse_port)
            return runner
        fast = FastHttpServer(self, runner.server, self.max_input_size, self.restricted, self.busy_poll)
        loop = asyncio.get_running_loop()
        if not listen:
            fast.start_sweeping(loop)
            return HttpListener(runner, fast, None)
        try:
            listener = await loop.create_server(
                fast, host, port, reuse_address=True, reuse_port=reuse_port or None, backlog=1024, ssl=ssl
            )
        except BaseException:
            await runner.cleanup()
            raise
        fast.start_sweeping(loop)
        return HttpListener(runner, fast, listener)


class HttpListener:
    """The running HTTP endpoint: the listening socket, its fast connections and the aiohttp app behind them."""

    def __init__(self, runner: web.AppRunner, fast: FastHttpServer, listener: asyncio.AbstractServer | None):
        self.runner = runner
        self.fast = fast
        self.listener = listener

    @property
    def server(self):
        return self.runner.server

    @property
    def protocol_factory(self) -> FastHttpServer:
        """What serves a connection accepted elsewhere (`loop.connect_accepted_socket`)."""
        return self.fast

    async def cleanup(self, timeout: float = 10.0) -> None:
        """Stop listening, let in-flight fast requests write their responses (idle connections close at
        once), then shut the aiohttp app down as AppRunner.cleanup always did."""
        if self.listener is not None:
            self.listener.close()
        await self.fast.shutdown(timeout)
        await self.runner.cleanup()
        if self.listener is None:
            return
        try:
            await asyncio.wait_for(self.listener.wait_closed(), 1.0)
        except asyncio.TimeoutError:
            pass


def protocol_factory(started: HttpListener | web.AppRunner):
    """The protocol factory behind what `HttpFrontend.start` (or `OpenAIFrontend.start`) returned."""
    return started.protocol_factory if isinstance(started, HttpListener) else started.server
