"""Prometheus metrics under Triton's names, read from the same counters as the statistics API.

Counters are produced at scrape time from `ModelStats` (no double counting); latency histograms and summaries
are fed by a stats observer. CPU metrics come from psutil, GPU metrics from NVML when it is available.
"""

from __future__ import annotations

import bisect
import logging
import threading

import psutil
from aiohttp import web
from prometheus_client import CollectorRegistry, Summary, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

log = logging.getLogger("naiad.metrics")

# Seconds; from 100 µs to 60 s, dense where model serving lives.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

_COUNTERS = [
    # name, help, how to read it from ModelStats
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.success.count,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        lambda s: s.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (does not include cached requests)",
        lambda s: s.execution_count,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (includes cached requests)",
        lambda s: (s.success.ns + s.fail.ns) // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
        lambda s: s.queue.ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
        lambda s: s.compute_input.ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
        lambda s: s.compute_infer.ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
        lambda s: s.compute_output.ns // 1000,
    ),
]
_HISTOGRAMS = {
    "request": ("nv_inference_request_duration_seconds", "Inference request latency in seconds"),
    "queue": ("nv_inference_queue_duration_seconds", "Inference queue time in seconds"),
    "compute_infer": (
        "nv_inference_compute_infer_duration_seconds",
        "Compute time (input, inference, output) in seconds",
    ),
}
_FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


def parse_metrics_config(items: list[str]) -> dict:
    """`--metrics-config key=value` settings with Triton's names and defaults (histograms on, beyond Triton)."""
    out = {
        "counter_latencies": True,
        "histogram_latencies": True,
        "summary_latencies": False,
        "summary_quantiles": "0.5:0.05,0.9:0.01,0.95:0.001,0.99:0.001",
    }
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in out:
            raise ValueError(f"invalid --metrics-config '{item}' (known: {', '.join(out)})")
        out[key] = (
            value if key == "summary_quantiles" else value.strip().lower() in ("1", "true", "yes", "on")
        )
    return out


class _ModelCollector:
    """Yields the per-model counter families from the live ModelStats at scrape time."""

    def __init__(self, server, settings: dict):
        self.server = server
        self.settings = settings

    def describe(self):
        return []

    def collect(self):
        versions = [mv for rec in self.server.repository.records.values() for mv in rec.versions.values()]
        fam = {}
        for name, doc, _ in _COUNTERS:
            if name.endswith("_us") and not self.settings["counter_latencies"]:
                continue
            fam[name] = Metric(name, doc, "counter")
        failure = Metric(
            "nv_inference_request_failure", "Number of failed inference requests, all batch sizes", "counter"
        )
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            labels=["model", "version"],
        )
        load = GaugeMetricFamily(
            "nv_model_load_duration_secs", "Model load time in seconds", labels=["model", "version"]
        )
        for mv in versions:
            s = mv.stats
            s.flush()  # (the latency histograms and summaries, collected after this, are fed by it too)
            labels = {"model": s.model, "version": s.version}
            with s.lock:
                for name, _, read in _COUNTERS:
                    if name in fam:
                        fam[name].add_sample(name, labels, read(s))
                for reason in _FAILURE_REASONS:
                    failure.add_sample(
                        "nv_inference_request_failure",
                        {**labels, "reason": reason},
                        s.failures_by_reason.get(reason, 0),
                    )
                pending.add_metric([s.model, s.version], s.pending)
            rec = self.server.repository.records.get(mv.name)
            load.add_metric([s.model, s.version], rec.load_seconds if rec else 0.0)
        # Triton keeps zero failure series for models that failed to load.
        for rec in self.server.repository.records.values():
            if not rec.versions:
                for v, (state, reason) in rec.version_states.items():
                    if state == "UNAVAILABLE" and reason and reason != "unloaded":
                        for r in _FAILURE_REASONS:
                            failure.add_sample(
                                "nv_inference_request_failure",
                                {"model": rec.name, "version": str(v), "reason": r},
                                0,
                            )
        yield fam["nv_inference_request_success"]
        yield failure
        for name, m in fam.items():
            if name != "nv_inference_request_success":
                yield m
        yield pending
        yield load
        if self.server.cache is not None:
            cache = [
                (
                    "nv_cache_num_hits_per_model",
                    "Number of cache hits per model",
                    lambda s: s.cache_hit.count,
                ),
                (
                    "nv_cache_num_misses_per_model",
                    "Number of cache misses per model",
                    lambda s: s.cache_miss.count,
                ),
                (
                    "nv_cache_hit_duration_per_model",
                    "Total cache hit duration per model, in microseconds",
                    lambda s: s.cache_hit.ns // 1000,
                ),
                (
                    "nv_cache_miss_duration_per_model",
                    "Total cache miss (insertion) duration per model, in microseconds",
                    lambda s: s.cache_miss.ns // 1000,
                ),
            ]
            for name, doc, read in cache:
                fam = GaugeMetricFamily(name, doc, labels=["model", "version"])
                for mv in versions:
                    if mv.config.response_cache.enable:
                        fam.add_metric([mv.stats.model, mv.stats.version], read(mv.stats))
                yield fam


class _LatencyHistogram:
    """One labelled latency histogram. prometheus_client's Histogram.observe walks the buckets in Python and
    takes a lock per bucket counter (~2-3 us); three per request showed in the profiles, so observations are
    counted here (C bisect, one lock) and exposed at scrape time as a HistogramMetricFamily."""

    __slots__ = ("counts", "lock", "sum")

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(LATENCY_BUCKETS, seconds)  # buckets are `le`: value <= bound
        with self.lock:
            self.counts[i] += 1
            self.sum += seconds

    def snapshot(self) -> tuple[list, float]:
        with self.lock:
            counts, total = list(self.counts), self.sum
        buckets, running = [], 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), counts):
            running += n
            buckets.append((floatToGoString(bound), running))
        return buckets, total


class _HistogramCollector:
    def __init__(self, histograms: dict[str, dict[tuple[str, str], _LatencyHistogram]]):
        self.histograms = histograms

    def describe(self):
        return []

    def collect(self):
        for kind, (name, doc) in _HISTOGRAMS.items():
            fam = HistogramMetricFamily(name, doc, labels=["model", "version"])
            for (model, version), hist in list(self.histograms[kind].items()):
                buckets, total = hist.snapshot()
                fam.add_metric([model, version], buckets, total)
            yield fam


class _SystemCollector:
    """CPU (psutil) and GPU (NVML) utilisation and memory, sampled every `interval_ms`."""

    def __init__(self, cpu: bool, gpu: bool):
        self.cpu = cpu
        self.gpu = gpu
        self.cpu_util = 0.0
        self.gpus = []
        self.nvml = None
        if gpu:
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml = pynvml
                for i in range(pynvml.nvmlDeviceGetCount()):
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    uuid = pynvml.nvmlDeviceGetUUID(h)
                    self.gpus.append((h, uuid.decode() if isinstance(uuid, bytes) else uuid))
            except Exception as exc:
                log.debug("GPU metrics unavailable: %s", exc)
                self.nvml = None
                self.gpus = []

    def sample(self) -> None:
        if self.cpu:
            self.cpu_util = psutil.cpu_percent(interval=None) / 100.0

    def describe(self):
        return []

    def collect(self):
        if self.cpu:
            mem = psutil.virtual_memory()
            yield GaugeMetricFamily(
                "nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", value=self.cpu_util
            )
            yield GaugeMetricFamily(
                "nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", value=mem.total
            )
            yield GaugeMetricFamily(
                "nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", value=mem.total - mem.available
            )
        if self.nvml is not None and self.gpus:
            n = self.nvml
            util = GaugeMetricFamily(
                "nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", labels=["gpu_uuid"]
            )
            total = GaugeMetricFamily(
                "nv_gpu_memory_total_bytes", "GPU total memory, in bytes", labels=["gpu_uuid"]
            )
            used = GaugeMetricFamily(
                "nv_gpu_memory_used_bytes", "GPU used memory, in bytes", labels=["gpu_uuid"]
            )
            power = GaugeMetricFamily("nv_gpu_power_usage", "GPU power usage in watts", labels=["gpu_uuid"])
            limit = GaugeMetricFamily(
                "nv_gpu_power_limit", "GPU power management limit in watts", labels=["gpu_uuid"]
            )
            for h, uuid in self.gpus:
                try:
                    u = n.nvmlDeviceGetUtilizationRates(h)
                    m = n.nvmlDeviceGetMemoryInfo(h)
                    util.add_metric([uuid], u.gpu / 100.0)
                    total.add_metric([uuid], m.total)
                    used.add_metric([uuid], m.used)
                    power.add_metric([uuid], n.nvmlDeviceGetPowerUsage(h) / 1000.0)
                    limit.add_metric([uuid], n.nvmlDeviceGetPowerManagementLimit(h) / 1000.0)
                except Exception as exc:
                    log.debug("NVML query failed: %s", exc)
            yield from (util, total, used, power, limit)


class Metrics:
    def __init__(self, server, settings: dict, cpu: bool = True, gpu: bool = True, interval_ms: int = 2000):
        self.server = server
        self.settings = settings
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ModelCollector(server, settings))
        self.system = _SystemCollector(cpu, gpu)
        self.registry.register(self.system)
        self.interval = max(0.1, interval_ms / 1000.0)
        self._triton_counters = [n.encode() for n, _, _ in _COUNTERS] + [b"nv_inference_request_failure"]
        self.histograms = {}
        self.summaries = {}
        self._children: dict[tuple[str, str], tuple[list, list, list]] = {}
        if settings["histogram_latencies"]:
            self.histograms = {kind: {} for kind in _HISTOGRAMS}
            self.registry.register(_HistogramCollector(self.histograms))
        if settings["summary_latencies"]:
            for kind, (name, doc) in _HISTOGRAMS.items():
                sname = name.replace("_seconds", "_summary_seconds")
                self.summaries[kind] = Summary(sname, doc, ["model", "version"], registry=self.registry)
        if self.histograms or self.summaries:
            server.stats_observers.append(self.observe)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, name="naiad-metrics", daemon=True)
        self._thread.start()

    def observe(
        self, model: str, version: str, request_s: float, queue_s: float | None, compute_s: float | None
    ) -> None:
        """Called once for every finished request; its labelled children are looked up once and cached."""
        children = self._children.get((model, version))
        if children is None:
            children = self._children[(model, version)] = (
                self._children_of("request", model, version),
                self._children_of("queue", model, version),
                self._children_of("compute_infer", model, version),
            )
        request, queue, compute = children
        for child in request:
            child.observe(request_s)
        if queue_s is not None:
            for child in queue:
                child.observe(queue_s)
        if compute_s is not None:
            for child in compute:
                child.observe(compute_s)

    def _children_of(self, kind: str, model: str, version: str) -> list:
        """The histogram and/or summary child that observes `kind` (request, queue, compute_infer) of a version."""
        children: list = []
        if kind in self.histograms:
            children.append(self.histograms[kind].setdefault((model, version), _LatencyHistogram()))
        if kind in self.summaries:
            children.append(self.summaries[kind].labels(model, version))
        return children

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.system.sample()

    def exposition(self) -> bytes:
        """prometheus-client's text exposition, with Triton's counter family names.

        prometheus-client names a counter family `<name>_total` in its HELP/TYPE lines; Triton's counters
        (`nv_inference_request_success`, ...) carry no suffix, and their samples here have none either. Only
        those header lines are renamed, so `# TYPE nv_inference_request_success counter` matches Triton.
        """
        text = generate_latest(self.registry)
        for name in self._triton_counters:
            text = text.replace(b"# HELP " + name + b"_total ", b"# HELP " + name + b" ", 1)
            text = text.replace(b"# TYPE " + name + b"_total counter", b"# TYPE " + name + b" counter", 1)
        custom = getattr(
            self.server, "custom_metrics", None
        )  # pb_utils.MetricFamily metrics, backend counters
        if custom is not None:
            text += custom.exposition()
        return text

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(body=self.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self, host: str, port: int, ssl=None) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, host, port, reuse_address=True, ssl_context=ssl).start()
        return runner

    def close(self) -> None:
        self._stop.set()
