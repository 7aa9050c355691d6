"""Prometheus families of model orchestration under naiad_* names: loads by cause, evictions by reason, load
waits, resident bytes per model and device, and the memory budget."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
AGE_BUCKETS = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


class _Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append((floatToGoString(bound), running))
        return out


class OrchestrationMetrics:
    """Counters the orchestrator and the on-demand loader record into; `collect` reads the repository too."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loads: dict[tuple[str, str, str], int] = defaultdict(int)  # (model, cause, outcome)
        self.load_seconds: dict[tuple[str, str], _Histogram] = {}
        self.evictions: dict[tuple[str, str], int] = defaultdict(int)
        self.eviction_age: dict[tuple[str, str], _Histogram] = {}
        self.waits: dict[str, _Histogram] = {}
        self.wait_failures: dict[tuple[str, str], int] = defaultdict(int)  # (model, reason)

    def load(self, model: str, cause: str, seconds: float, ok: bool) -> None:
        with self.lock:
            self.loads[(model, cause, "success" if ok else "failure")] += 1
            if ok:
                self.load_seconds.setdefault((model, cause), _Histogram(LOAD_BUCKETS)).observe(seconds)

    def eviction(self, model: str, reason: str, age_seconds: float) -> None:
        with self.lock:
            self.evictions[(model, reason)] += 1
            self.eviction_age.setdefault((model, reason), _Histogram(AGE_BUCKETS)).observe(age_seconds)

    def waited(self, model: str, seconds: float) -> None:
        with self.lock:
            self.waits.setdefault(model, _Histogram(LOAD_BUCKETS)).observe(seconds)

    def wait_failed(self, model: str, reason: str) -> None:
        with self.lock:
            self.wait_failures[(model, reason)] += 1


class OrchestrationCollector:
    """A prometheus_client collector over the server's orchestration metrics and its models' memory figures."""

    def __init__(self, server):
        self.server = server

    def describe(self):
        return []

    def collect(self):
        orch = self.server.repository.orchestrator
        m = orch.metrics
        with m.lock:
            loads = CounterMetricFamily(
                "naiad_model_loads", "Model loads by cause and outcome", labels=["model", "cause", "outcome"]
            )
            for (model, cause, outcome), n in sorted(m.loads.items()):
                loads.add_metric([model, cause, outcome], n)
            duration = HistogramMetricFamily(
                "naiad_model_load_duration_seconds",
                "Duration of successful model loads (warm-up included) by cause",
                labels=["model", "cause"],
            )
            for (model, cause), h in sorted(m.load_seconds.items()):
                duration.add_metric([model, cause], h.buckets(), h.sum)
            evictions = CounterMetricFamily(
                "naiad_model_evictions",
                "Models unloaded by the server, by reason",
                labels=["model", "reason"],
            )
            for (model, reason), n in sorted(m.evictions.items()):
                evictions.add_metric([model, reason], n)
            age = HistogramMetricFamily(
                "naiad_model_eviction_age_seconds",
                "Time a model had been loaded when it was evicted",
                labels=["model", "reason"],
            )
            for (model, reason), h in sorted(m.eviction_age.items()):
                age.add_metric([model, reason], h.buckets(), h.sum)
            waits = HistogramMetricFamily(
                "naiad_model_load_wait_seconds",
                "Time requests waited for their model to load on demand",
                labels=["model"],
            )
            for model, h in sorted(m.waits.items()):
                waits.add_metric([model], h.buckets(), h.sum)
            wait_failures = CounterMetricFamily(
                "naiad_model_load_wait_failures",
                "Requests for a model loading on demand that were answered with an error, by reason",
                labels=["model", "reason"],
            )
            for (model, reason), n in sorted(m.wait_failures.items()):
                wait_failures.add_metric([model, reason], n)
        resident = GaugeMetricFamily(
            "naiad_model_memory_bytes",
            "Memory a loaded model holds per device (measured after load and warm-up; declared until then)",
            labels=["model", "device", "source"],
        )
        for name, memory, source in orch.resident_models():
            for device, nbytes in sorted(memory.items()):
                resident.add_metric([name, device, source], nbytes)
        used = GaugeMetricFamily(
            "naiad_model_memory_resident_bytes",
            "Memory the loaded models hold, per device",
            labels=["device"],
        )
        for device, nbytes in sorted(orch.resident_total().items()):
            used.add_metric([device], nbytes)
        limit = GaugeMetricFamily(
            "naiad_model_memory_limit_bytes", "The --model-memory-limit budget, per device", labels=["device"]
        )
        if orch.budget is not None:
            for device, nbytes in sorted(orch.budget.limits.items()):
                limit.add_metric([device], nbytes)
        yield from (loads, duration, evictions, age, waits, wait_failures, resident, used, limit)
