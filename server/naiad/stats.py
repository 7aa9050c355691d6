"""Per-model-version counters, recorded once at the scheduler/instance boundary.

The statistics extension and the Prometheus metrics both read these; nothing else counts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

NS_PER_US = 1000


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, n: int = 1) -> None:
        self.count += n
        self.ns += ns

    def as_dict(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStat:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


# observer(model, version, request_s, queue_s, compute_s) for the latency histograms, once per finished request;
# queue_s and compute_s are None for a failed request (Triton observes only the request duration then)
Observer = Callable[[str, str, float, "float | None", "float | None"], None]


class ModelStats:
    """Counters of one model version. Methods are called from instance threads and the event loop."""

    def __init__(self, model: str, version: str):
        self.model = model
        self.version = version
        self.lock = threading.Lock()
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.cache_hit = Duration()
        self.cache_miss = Duration()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.pending = 0
        self.batch_stats: dict[int, BatchStat] = {}
        self.failures_by_reason: dict[str, int] = {}
        self.response_stats: dict[str, dict] = {}
        self.observers: list[Observer] = []
        # executions recorded by record_run, counted at the end of the event loop's turn (flush); a flush is
        # queued whenever the list stops being empty
        self._deferred: list[tuple[int, int, int, int, list[tuple[bool, int, int]]]] = []

    def record_execution(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One execution of the model on a (possibly batched) set of requests."""
        with self.lock:
            self._count_execution(batch_size, input_ns, infer_ns, output_ns)

    def _count_execution(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.execution_count += 1
        self.inference_count += batch_size
        b = self.batch_stats.get(batch_size)
        if b is None:
            b = self.batch_stats[batch_size] = BatchStat()
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)

    def record_request(
        self,
        ok: bool,
        total_ns: int,
        queue_ns: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        reason: str = "OTHER",
    ) -> None:
        """One request finished (each request in a batch is charged the batch's compute times)."""
        with self.lock:
            self.last_inference_ms = int(time.time() * 1000)
            self._count_request(ok, total_ns, queue_ns, input_ns, infer_ns, output_ns, reason)
        if self.observers:
            self._observe(ok, total_ns, queue_ns, input_ns + infer_ns + output_ns)

    def _count_request(
        self,
        ok: bool,
        total_ns: int,
        queue_ns: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        reason: str,
    ) -> None:
        if ok:
            self.success.add(total_ns)
            self.queue.add(queue_ns)
            self.compute_input.add(input_ns)
            self.compute_infer.add(infer_ns)
            self.compute_output.add(output_ns)
        else:
            self.fail.add(total_ns)
            self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1

    def _observe(self, ok: bool, total_ns: int, queue_ns: int, compute_ns: int) -> None:
        for obs in self.observers:
            obs(
                self.model,
                self.version,
                total_ns / 1e9,
                queue_ns / 1e9 if ok else None,
                compute_ns / 1e9 if ok else None,
            )

    def record_run(
        self,
        batch_size: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        requests: list[tuple[bool, int, int]],
    ) -> None:
        """One execution and its requests (ok, total ns, queue ns each), recorded as record_execution and
        record_request would, at the end of this turn of the event loop: after the responses have been written,
        not on the way to them. Call it on the loop. Readers (as_dict, the metrics collector) flush first, so
        a reader never sees a finished request uncounted."""
        with self.lock:
            self._deferred.append((batch_size, input_ns, infer_ns, output_ns, requests))
            first = len(self._deferred) == 1
        if first:  # (the loop asked for once a turn: on Python 3.11 asking makes a getpid system call)
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Count what record_run deferred (under one hold of the lock: the loop runs it once a turn)."""
        with self.lock:
            deferred, self._deferred = self._deferred, []
            if not deferred:
                return
            self.last_inference_ms = int(time.time() * 1000)
            for batch_size, input_ns, infer_ns, output_ns, requests in deferred:
                self._count_execution(batch_size, input_ns, infer_ns, output_ns)
                for ok, total_ns, queue_ns in requests:
                    self._count_request(ok, total_ns, queue_ns, input_ns, infer_ns, output_ns, "BACKEND")
        if self.observers:
            for _, input_ns, infer_ns, output_ns, requests in deferred:
                for ok, total_ns, queue_ns in requests:
                    self._observe(ok, total_ns, queue_ns, input_ns + infer_ns + output_ns)

    def record_cache(self, hit: bool, ns: int) -> None:
        with self.lock:
            (self.cache_hit if hit else self.cache_miss).add(ns)

    def record_response(self, key: str, ns: int, ok: bool, empty: bool) -> None:
        """Decoupled models: per-response statistics, keyed by the response's index."""
        with self.lock:
            entry = self.response_stats.get(key)
            if entry is None:  # (not setdefault: that built six Durations per response, per streamed token)
                entry = self.response_stats[key] = {
                    "compute_infer": Duration(),
                    "compute_output": Duration(),
                    "success": Duration(),
                    "fail": Duration(),
                    "empty_response": Duration(),
                    "cancel": Duration(),
                }
            entry["empty_response" if empty else ("success" if ok else "fail")].add(ns)

    def as_dict(self) -> dict:
        """Triton's statistics extension JSON for this version."""
        self.flush()
        with self.lock:
            return {
                "name": self.model,
                "version": self.version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {
                    "success": self.success.as_dict(),
                    "fail": self.fail.as_dict(),
                    "queue": self.queue.as_dict(),
                    "compute_input": self.compute_input.as_dict(),
                    "compute_infer": self.compute_infer.as_dict(),
                    "compute_output": self.compute_output.as_dict(),
                    "cache_hit": self.cache_hit.as_dict(),
                    "cache_miss": self.cache_miss.as_dict(),
                },
                "response_stats": {
                    k: {n: d.as_dict() for n, d in v.items()} for k, v in self.response_stats.items()
                },
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": b.compute_input.as_dict(),
                        "compute_infer": b.compute_infer.as_dict(),
                        "compute_output": b.compute_output.as_dict(),
                    }
                    for size, b in sorted(self.batch_stats.items())
                ],
                "memory_usage": [],
            }
