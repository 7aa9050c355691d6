"""Server: the in-process API. Frontends, BLS and ensembles all come through here."""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import __version__, backends, device_tensors
from .cache import ResponseCache, request_key
from .classification import classify
from .custom_metrics import CustomMetrics
from .errors import Internal, InvalidArgument, NaiadError, Unavailable
from .inference import InferenceRequest, InferenceResponse, OutputTensor
from .logsettings import LogSettings
from .orchestration.memory_budget import MemoryBudget
from .orchestration.on_demand import OnDemandLoader
from .orchestration.orchestrator import ModelOrchestrator
from .repository import ModelRepository
from .scheduling.handoff import Handoff
from .scheduling.ratelimit import RateLimiter
from .trace import Tracer
from .version_string import parse_version
from .warmup import run_warmup

if TYPE_CHECKING:
    from .model import ModelVersion
    from .serving import Serving

log = logging.getLogger("naiad.server")

CONTROL_MODES = ("none", "poll", "explicit")


@dataclass
class ServerOptions:
    model_repositories: list[str] = field(default_factory=list)
    model_control_mode: str = "none"
    load_models: list[str] = field(default_factory=list)
    load_model_configs: dict[str, dict] = field(default_factory=dict)  # a startup load's `config` override
    repository_poll_secs: float = 15.0
    strict_readiness: bool = True
    exit_timeout_secs: float = 30.0
    auto_complete_config: bool = True
    gpu_count: int = 0
    allow_client_shm: bool = True
    cache_size: int = 0  # bytes; 0: no response cache
    rate_limit: str = "off"  # off | execution_count
    rate_limit_resources: dict = field(default_factory=dict)
    backend_directory: str | None = None  # Triton's python-based backends: <dir>/<name>/model.py
    storage_cache_dir: str | None = None  # where s3:// and https:// models are copied (None: the default)
    load_on_demand: bool = False  # explicit mode: a request for an unloaded model loads it and waits
    load_on_demand_max_waiters: int = 1000  # per model; beyond: 429 / UNAVAILABLE with Retry-After
    load_on_demand_timeout: float = 120.0  # seconds a request waits for its model's load
    model_memory_limit: dict = field(default_factory=dict)  # {'host': bytes, 'gpu0': bytes}; empty: no budget


class Server:
    """Repository, schedulers and statistics, usable with or without any network frontend; the frontends call it
    through the serving API it implements (`serving.Serving`)."""

    name = "naiad"

    def __init__(self, options: ServerOptions):
        if options.model_control_mode not in CONTROL_MODES:
            raise InvalidArgument(
                f"unknown model control mode '{options.model_control_mode}' "
                f"(expected one of {', '.join(CONTROL_MODES)})"
            )
        self.options = options
        self.backends = backends.configure(options.backend_directory)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stats_observers: list = []
        self.custom_metrics = CustomMetrics()  # pb_utils.MetricFamily and backend counters, on /metrics
        self.repository = ModelRepository(
            options.model_repositories,
            self,
            auto_complete=options.auto_complete_config,
            gpu_count=options.gpu_count,
            cache_dir=options.storage_cache_dir,
        )
        self.orchestrator = ModelOrchestrator(
            self.repository,
            gpu_count=options.gpu_count,
            budget=MemoryBudget(options.model_memory_limit) if options.model_memory_limit else None,
        )
        self.repository.orchestrator = self.orchestrator
        # the repository index carries each model's memory when the server manages it
        self.orchestrated = options.load_on_demand or bool(options.model_memory_limit)
        self.on_demand: OnDemandLoader | None = None
        if options.load_on_demand:
            if options.model_control_mode != "explicit":
                raise InvalidArgument("--load-on-demand needs --model-control-mode explicit")
            self.on_demand = OnDemandLoader(
                self.repository, options.load_on_demand_max_waiters, options.load_on_demand_timeout
            )
        self.rate_limiter = (
            RateLimiter(options.rate_limit_resources) if options.rate_limit == "execution_count" else None
        )
        self.cache = ResponseCache(options.cache_size) if options.cache_size > 0 else None
        self.log_settings = LogSettings()
        self.tracer = Tracer()
        self.extensions = [
            "classification",
            "sequence",
            "model_repository",
            "model_repository(unload_dependents)",
            "schedule_policy",
            "model_configuration",
            "binary_tensor_data",
            "parameters",
            "statistics",
            "trace",
            "logging",
        ]
        if options.allow_client_shm:
            self.extensions.insert(6, "system_shared_memory")
        self._started = False
        self._stopping = False
        self.draining = False  # SIGTERM: open connections are still served, but the server is no longer ready
        # set by the app while it opens its listeners: not ready until every one is up (a readiness probe answered
        # on the HTTP port must not send gRPC clients to a port that is not listening yet, or never will be)
        self.opening_listeners = False
        self._inflight = 0
        self._handoff: Handoff | None = None  # decoupled responses to the event loop (infer_stream)
        self._idle = asyncio.Event()
        self._poll_task: asyncio.Task | None = None

    # ---- lifecycle ----
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        mode = self.options.model_control_mode
        await self.repository.refresh()
        if mode in ("none", "poll"):
            names = list(self.repository.scan())
        else:
            wanted = self.options.load_models
            names = list(self.repository.scan()) if "*" in wanted else list(dict.fromkeys(wanted))
        await self.repository.load_many(names, configs=self.options.load_model_configs)
        self.orchestrator.start()
        if mode == "poll":
            self._poll_task = self.loop.create_task(self._poll_forever())
        self._started = True

    async def _poll_forever(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.options.repository_poll_secs)
            try:
                await self.repository.poll()
            except Exception:
                log.exception("repository poll failed")

    async def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, wait for in-flight ones (up to `timeout`), then unload everything."""
        self._stopping = True
        if self._poll_task is not None:
            self._poll_task.cancel()
        timeout = self.options.exit_timeout_secs if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        await self.orchestrator.close()
        await self.repository.close(max(0.0, deadline - time.monotonic()))
        self.backends.finalize()
        await asyncio.get_running_loop().run_in_executor(None, self.tracer.shutdown)

    # ---- health and metadata ----
    def live(self) -> bool:
        return not self._stopping

    def ready(self) -> bool:
        """Ready once started; with strict readiness, only while no model has failed to load and every remote
        repository could be listed."""
        if not self._started or self._stopping or self.draining or self.opening_listeners:
            return False
        if not self.options.strict_readiness:
            return True
        if self.repository.source_errors:
            return False
        # (a model that failed to load because a request asked for it leaves the server ready: no client may
        # take a server out of service by asking for a broken model)
        return not any(
            rec.reason and rec.reason != "unloaded" and not rec.versions and rec.cause != "on_demand"
            for rec in self.repository.records.values()
        )

    def metadata(self) -> dict:
        return {"name": self.name, "version": __version__, "extensions": list(self.extensions)}

    def model(self, name: str, version: str | int = "") -> ModelVersion:
        return self.repository.get(name, parse_version(version))

    def model_metadata(self, name: str, version: str | int = "") -> dict:
        mv = self.model(name, version)
        rec = self.repository.records[name]
        return mv.metadata([str(v) for v in sorted(rec.versions)])

    def model_ready(self, name: str, version: str | int = "") -> bool:
        """Loaded, and every instance can serve (a python worker being restarted cannot)."""
        v = parse_version(version)
        if not self.repository.is_ready(name, v):
            return False
        pool = self.repository.get(name, v).pool
        return pool is None or all(inst.ready() for inst in pool.instances)

    def model_statistics(self, name: str = "", version: str | int = "") -> list[dict]:
        if not name:
            return [
                mv.stats.as_dict()
                for rec in sorted(self.repository.records.values(), key=lambda r: r.name)
                for _, mv in sorted(rec.versions.items())
            ]
        v = parse_version(version)
        rec = self.repository.records.get(name)
        if rec is None or not rec.versions:
            raise InvalidArgument(f"requested model '{name}' is not available")
        if v > 0:
            mv = rec.versions.get(v)
            if mv is None:
                raise InvalidArgument(f"requested model version is not available for model '{name}'")
            return [mv.stats.as_dict()]
        return [mv.stats.as_dict() for _, mv in sorted(rec.versions.items())]

    # ---- repository extension ----
    def _check_explicit(self, what: str) -> None:
        if self.options.model_control_mode != "explicit":
            raise Unavailable(f"explicit model {what} is not allowed if polling is enabled")

    async def load_model(
        self, name: str, config: str | dict | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        self._check_explicit("load / unload")
        if files and not config:
            raise InvalidArgument(
                "failed to load '" + name + "': model configuration must be provided "
                "with file overrides ('config' parameter)"
            )
        await self.repository.load(name, config, files)

    async def ready_model(self, name: str, version: str | int = "") -> tuple[ModelVersion, int]:
        """The ready model version an inference request asks for, and the ns it waited: with --load-on-demand a
        model in a repository that is not loaded is loaded first. (Metadata, config and readiness lookups never
        load: they use `model`.)"""
        v = parse_version(version)
        try:
            return self.repository.get(name, v), 0
        except NaiadError as exc:
            if self.on_demand is None:
                raise
            return await self.on_demand.ready_model(name, v, exc)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._check_explicit("load / unload")
        await self.repository.unload(name, unload_dependents)

    # ---- inference ----
    async def _load_on_demand(self, request: InferenceRequest, miss: NaiadError) -> ModelVersion:
        """The model a request names that is not loaded: loaded for it with --load-on-demand (the wait recorded on
        the request), else the lookup's error."""
        if self.on_demand is None:
            raise miss
        mv, request.load_wait_ns = await self.on_demand.ready_model(
            request.model_name, request.model_version, miss
        )
        return mv

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Run one request to completion; errors are raised as NaiadError."""
        if self._stopping:
            raise Unavailable("Server is shutting down")
        try:
            mv = self.repository.get(request.model_name, request.model_version)
        except NaiadError as miss:
            mv = await self._load_on_demand(request, miss)
        if mv.decoupled:
            raise InvalidArgument(
                f"ModelInfer RPC doesn't support models with decoupled transaction policy; use "
                f"ModelStreamInfer (gRPC) or /generate_stream (HTTP) for model '{request.model_name}'"
            )
        if request.device_inputs:
            device_tensors.place_inputs(request, mv.config)
        mv.validate(request)
        cache_key = None
        # (GPU inputs, kept for a model that takes them, are not hashed: such a request is not cached)
        if self.cache is not None and mv.config.response_cache.enable and not request.device_inputs:
            t0 = time.monotonic_ns()
            cache_key = request_key(request, mv.version)
            hit = self.cache.get(cache_key)
            if hit is not None:
                ns = time.monotonic_ns() - t0
                mv.stats.record_cache(True, ns)
                mv.stats.record_request(True, time.monotonic_ns() - request.arrival_ns, 0, 0, 0, 0)
                return InferenceResponse(
                    model_name=mv.name, model_version=str(mv.version), id=request.id, outputs=list(hit)
                )
            miss_ns = time.monotonic_ns() - t0
        trace = self.tracer.start(mv, request)
        self._inflight += 1
        response = None
        try:
            response = await mv.infer(request)
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()
            if trace is not None:
                self.tracer.finish(mv, trace, sys.exc_info()[1] if response is None else response.error)
        if response is None:  # only decoupled models answer through the callback, and they were refused above
            raise Internal(f"model '{mv.name}' returned no response")
        if response.error is not None:
            raise (
                response.error
                if isinstance(response.error, NaiadError)
                else InvalidArgument(str(response.error))
            )
        response.model_name = mv.name
        response.model_version = str(mv.version)
        response.id = request.id
        if response.device_outputs and (
            not request.device_consumer or cache_key is not None or mv.output_reshape or _classifies(request)
        ):
            device_tensors.outputs_to_host(response)
        if mv.output_reshape:
            mv.reshape_outputs(response)
        self._postprocess(mv, request, response)
        if cache_key is not None and self.cache is not None:
            t0 = time.monotonic_ns()
            self.cache.put(cache_key, response)
            mv.stats.record_cache(False, miss_ns + time.monotonic_ns() - t0)
        return response

    async def infer_stream(self, request: InferenceRequest) -> AsyncGenerator[InferenceResponse, None]:
        """Decoupled (or not) inference as a stream of responses; the last one has `final` set."""
        if self._stopping:
            raise Unavailable("Server is shutting down")
        try:
            mv = self.repository.get(request.model_name, request.model_version)
        except NaiadError as miss:
            mv = await self._load_on_demand(request, miss)
        if not mv.decoupled:
            yield await self.infer(request)
            return
        if request.device_inputs:
            device_tensors.place_inputs(request, mv.config)
        mv.validate(request)
        loop = asyncio.get_running_loop()
        handoff = self._handoff
        if handoff is None or handoff.loop is not loop:
            handoff = self._handoff = Handoff(loop)
        # responses arrive in `ready` (on the loop, through the handoff); the generator waits on `waiter[0]` when
        # there is none, and the execution's end wakes it too. No Task per response: a token is a response.
        ready: collections.deque[InferenceResponse] = collections.deque()
        waiter: list[asyncio.Future | None] = [None]
        user_callback = request.response_callback
        started = time.monotonic_ns()
        counter = [0]
        trace = self.tracer.start(mv, request)
        error: BaseException | None = None
        execution = None

        def wake(_=None) -> None:
            w = waiter[0]
            if w is not None and not w.done():
                w.set_result(None)

        def arrived(resp: InferenceResponse) -> None:
            ready.append(resp)
            wake()

        def deliver(resp: InferenceResponse) -> None:
            key = str(counter[0])
            counter[0] += 1
            if trace is not None:
                trace.append(("INFER_RESPONSE_COMPLETE", time.monotonic_ns()))
            mv.stats.record_response(
                key,
                time.monotonic_ns() - started,
                resp.error is None,
                not resp.outputs and resp.error is None,
            )
            handoff.post(arrived, resp)

        request.response_callback = deliver
        self._inflight += 1
        try:
            run: asyncio.Future[InferenceResponse | None] = loop.create_task(mv.infer(request))
            execution = run
            run.add_done_callback(wake)
            while True:
                if ready:
                    resp = ready.popleft()
                    resp.model_name, resp.model_version, resp.id = mv.name, str(mv.version), request.id
                    error = resp.error or error
                    if resp.error is None:
                        if resp.device_outputs and (
                            not request.device_consumer or mv.output_reshape or _classifies(request)
                        ):
                            device_tensors.outputs_to_host(resp)
                        if mv.output_reshape:
                            mv.reshape_outputs(resp)
                        self._postprocess(mv, request, resp)
                    if user_callback is not None:
                        user_callback(resp)
                    resp.more_ready = bool(ready)
                    yield resp
                    if resp.final:
                        break
                    continue
                if run.done():
                    exc = run.exception()
                    if exc is not None:
                        error = exc
                        raise exc
                # (execute returned: responses still come later from the model's own threads)
                waiter[0] = wait = loop.create_future()
                try:
                    await wait
                finally:
                    waiter[0] = None
        finally:
            request.cancelled = True
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()
            if trace is not None:
                # the final response can arrive before the execution has recorded its compute timestamps
                if execution is None or execution.done():
                    self.tracer.finish(mv, trace, error)
                else:
                    execution.add_done_callback(lambda _: self.tracer.finish(mv, trace, error))

    def _postprocess(self, mv, request: InferenceRequest, response: InferenceResponse) -> None:
        """Classification extension: replace outputs asked for with `classification: k` by top-k labels."""
        for out in request.outputs:
            if out.classification:
                tensor = response.output(out.name)
                if tensor is not None:
                    labels = mv.ctx.extra.get("labels", {}).get(out.name)
                    if labels is None:
                        labels = mv.ctx.extra.setdefault("labels", {})[out.name] = _labels(mv, out.name)
                    data = classify(tensor.data, out.classification, labels, mv.max_batch_size > 0)
                    idx = response.outputs.index(tensor)
                    response.outputs[idx] = OutputTensor(out.name, "BYTES", data)

    def warmup(self, mv) -> None:
        """Run the model's warmup samples on every instance before it is marked ready (loader thread)."""
        run_warmup(mv)


def _classifies(request: InferenceRequest) -> bool:
    return any(o.classification for o in request.outputs)


def _labels(mv, output_name: str) -> list[str]:
    for o in mv.config.output:
        if o.name == output_name and o.label_filename:
            path = mv.ctx.model_dir / o.label_filename
            try:
                return path.read_text().splitlines()
            except OSError as exc:
                log.warning("cannot read labels %s: %s", path, exc)
    return []


if TYPE_CHECKING:

    def _serves(server: Server) -> Serving:
        """(mypy) Server implements the serving API the frontends call."""
        return server
