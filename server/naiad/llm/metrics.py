"""The token metrics every LLM engine reports on `/metrics`, under vLLM's names (`vllm:...`, label `model_name`).

They live in the server's custom-metrics registry (server.custom_metrics, the one pb_utils.MetricFamily writes),
so they render next to Triton's `nv_inference_*` families and leave /metrics when the model unloads. An engine
holds one `EngineMetrics` per model instance and one `RequestMetrics` per request:

    metrics = EngineMetrics(server, "llama")
    req = metrics.arrived()          # queued: vllm:num_requests_waiting += 1
    req.scheduled()                  # in a slot: waiting -= 1, vllm:num_requests_running += 1
    req.tokens(1)                    # first call: time to first token; later ones: inter-token latency
    req.finished(12, 30, "stop")     # running -= 1, e2e latency, token histograms and counters

Names, kinds and buckets follow vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py), which is what dashboards
and the Gateway API Inference Extension's endpoint picker read (`vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:lora_requests_info`); an engine that speculates
adds vLLM's `vllm:spec_decode_*` counters (enable_spec_decode, spec_decode). Counters are registered
under their exposed name (`vllm:prompt_tokens_total`), as prometheus_client renders vLLM's `vllm:prompt_tokens`.
The inter-token histogram has three buckets below vLLM's first (1, 2.5 and 5 ms): CPU engines step that fast.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..custom_metrics import COUNTER, GAUGE, HISTOGRAM

TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
E2E_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


def token_buckets(max_value: int) -> list[float]:
    """vLLM's 1-2-5 buckets up to `max_value` (the context length): 1, 2, 5, 10, 20, 50, ..."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(float(m * scale))
        scale *= 10


# name -> (kind, help, buckets or None); token histograms get their buckets from the context length
_FAMILIES: dict[str, tuple[int, str, list[float] | None]] = {
    "vllm:num_requests_running": (GAUGE, "Number of requests in model execution batches.", None),
    "vllm:num_requests_waiting": (GAUGE, "Number of requests waiting to be processed.", None),
    "vllm:kv_cache_usage_perc": (GAUGE, "KV-cache usage. 1 means 100 percent usage.", None),
    "vllm:prompt_tokens_total": (COUNTER, "Number of prefill tokens processed.", None),
    "vllm:generation_tokens_total": (COUNTER, "Number of generation tokens processed.", None),
    "vllm:time_to_first_token_seconds": (
        HISTOGRAM, "Histogram of time to first token in seconds.", TTFT_BUCKETS,
    ),
    "vllm:inter_token_latency_seconds": (
        HISTOGRAM, "Histogram of inter-token latency in seconds.", ITL_BUCKETS,
    ),
    "vllm:e2e_request_latency_seconds": (
        HISTOGRAM, "Histogram of e2e request latency in seconds.", E2E_BUCKETS,
    ),
    "vllm:request_prompt_tokens": (HISTOGRAM, "Number of prefill tokens processed.", []),
    "vllm:request_generation_tokens": (HISTOGRAM, "Number of generation tokens processed.", []),
}  # fmt: skip
_SUCCESS = "vllm:request_success_total"
_LORA = "vllm:lora_requests_info"
# speculative decoding (vllm/v1/spec_decode/metrics.py's SpecDecodingProm), registered by enable_spec_decode
_SPEC_DECODE = {
    "vllm:spec_decode_num_drafts_total": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens_total": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens_total": "Number of accepted tokens.",
}
_SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class EngineMetrics:
    """One engine's (model instance's) token metrics. Thread-safe; with `server` None nothing is exported,
    but every call still works (in-process engines, tests)."""

    def __init__(self, server: Any, model_name: str, max_model_len: int = 65536) -> None:
        self.model_name = model_name
        self._registry = getattr(server, "custom_metrics", None) if server is not None else None
        self._owner = object()  # what this engine holds in the registry; released by close()
        self._ids: dict[str, int] = {}
        self._success: dict[str, int] = {}
        self._lora_owner: object | None = None
        self._lora_family: int | None = None
        self._spec_per_pos: list[
            int
        ] = []  # vllm:spec_decode_num_accepted_tokens_per_pos's series by position
        self._lock = threading.Lock()
        self._closed = False
        # what the gauges say, kept here too so that the engine can read them without the registry
        self.running = 0
        self.waiting = 0
        if self._registry is None:
            return
        labels = {"model_name": model_name}
        for name, (kind, help_text, buckets) in _FAMILIES.items():
            if buckets == []:
                buckets = token_buckets(max(1, int(max_model_len)))
            fid = self._registry.family(name, help_text, kind, owner=self._owner)
            self._ids[name] = self._registry.metric(fid, labels, buckets, owner=self._owner)
        fid = self._registry.family(
            _SUCCESS, "Count of successfully processed requests.", COUNTER, self._owner
        )
        for reason in FINISH_REASONS:
            self._success[reason] = self._registry.metric(
                fid, {**labels, "finished_reason": reason}, owner=self._owner
            )

    # ---- what the engine reports ----
    def arrived(self) -> RequestMetrics:
        """A request entered the engine's queue (vllm:num_requests_waiting += 1)."""
        with self._lock:
            self.waiting += 1
        self._update("vllm:num_requests_waiting", "increment", 1)
        return RequestMetrics(self)

    def set_kv_cache_usage(self, fraction: float) -> None:
        """vllm:kv_cache_usage_perc: the fraction (0..1) of the KV cache in use."""
        self._update("vllm:kv_cache_usage_perc", "set", min(1.0, max(0.0, float(fraction))))

    def set_lora(self, running: list[str], waiting: list[str], max_lora: int) -> None:
        """vllm:lora_requests_info: one series whose labels list the adapters in use and waiting, valued at
        the time of the update (as vLLM sets it; the endpoint picker reads the newest)."""
        if self._registry is None or self._closed:
            return
        labels = {
            "model_name": self.model_name,
            "running_lora_adapters": ",".join(running),
            "waiting_lora_adapters": ",".join(waiting),
            "max_lora": str(int(max_lora)),
        }
        with self._lock:
            if self._lora_family is None:
                self._lora_family = self._registry.family(
                    _LORA, "Running stats on lora requests.", GAUGE, owner=self._owner
                )
            previous, self._lora_owner = self._lora_owner, object()
            mid = self._registry.metric(self._lora_family, labels, owner=self._lora_owner)
            self._registry.update(mid, "set", time.time())
            if previous is not None:
                self._registry.release(previous)  # the old label set leaves /metrics

    def enable_spec_decode(self, num_spec_tokens: int) -> None:
        """The engine speculates (at most `num_spec_tokens` draft tokens a step): vLLM's spec_decode counters appear,
        the per-position one with a series for each position (label `position`, 0 the first draft token)."""
        if self._registry is None or self._closed or self._spec_per_pos:
            return
        labels = {"model_name": self.model_name}
        for name, help_text in _SPEC_DECODE.items():
            fid = self._registry.family(name, help_text, COUNTER, owner=self._owner)
            self._ids[name] = self._registry.metric(fid, labels, owner=self._owner)
        fid = self._registry.family(
            _SPEC_PER_POS, "Accepted tokens per draft position.", COUNTER, self._owner
        )
        self._spec_per_pos = [
            self._registry.metric(fid, {**labels, "position": str(pos)}, owner=self._owner)
            for pos in range(max(1, int(num_spec_tokens)))
        ]

    def spec_decode(self, drafts: int, draft_tokens: int, accepted: int, accepted_per_pos: list[int]) -> None:
        """What a step's verification found: `drafts` sequences verified a draft of `draft_tokens` tokens in all,
        `accepted` of which the model took; `accepted_per_pos[i]`: how many drafts had position i accepted."""
        if not self._spec_per_pos or self._closed:
            return
        self._update("vllm:spec_decode_num_drafts_total", "increment", drafts)
        self._update("vllm:spec_decode_num_draft_tokens_total", "increment", draft_tokens)
        self._update("vllm:spec_decode_num_accepted_tokens_total", "increment", accepted)
        for mid, n in zip(self._spec_per_pos, accepted_per_pos, strict=False):
            if n:
                try:
                    self._registry.update(mid, "increment", n)
                except Exception:
                    pass

    def close(self) -> None:
        """The engine unloads: this model's series leave /metrics (unless another instance still holds them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lora, self._lora_owner = self._lora_owner, None
        if self._registry is not None:
            if lora is not None:
                self._registry.release(lora)
            # a gauge shared with other instances of the model must not keep this instance's requests
            if self.running:
                self._update_always("vllm:num_requests_running", "increment", -self.running)
            if self.waiting:
                self._update_always("vllm:num_requests_waiting", "increment", -self.waiting)
            self._registry.release(self._owner)

    # ---- plumbing ----
    def _update(self, name: str, op: str, value: float) -> None:
        if self._registry is not None and not self._closed:
            self._update_always(name, op, value)

    def _update_always(self, name: str, op: str, value: float) -> None:
        try:
            self._registry.update(self._ids[name], op, value)
        except Exception:  # the series left /metrics under us (an unload racing the last request)
            pass

    def _success_inc(self, reason: str) -> None:
        if self._registry is None or self._closed:
            return
        mid = self._success.get(reason)
        if mid is None:  # a reason vLLM does not list: count it under its own label
            fid = self._registry.family(
                _SUCCESS, "Count of successfully processed requests.", COUNTER, self._owner
            )
            mid = self._success[reason] = self._registry.metric(
                fid, {"model_name": self.model_name, "finished_reason": reason}, owner=self._owner
            )
        try:
            self._registry.update(mid, "increment", 1)
        except Exception:
            pass


class RequestMetrics:
    """One request's timings, from `EngineMetrics.arrived()` to `finished()`."""

    __slots__ = ("_engine", "_last", "_state", "arrival", "first_token")

    _WAITING, _RUNNING, _DONE = 0, 1, 2

    def __init__(self, engine: EngineMetrics) -> None:
        self._engine = engine
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self._last = 0.0
        self._state = self._WAITING

    def scheduled(self) -> None:
        """The request got a slot: waiting -= 1, running += 1 (a second call does nothing)."""
        engine = self._engine
        with engine._lock:
            if self._state != self._WAITING:
                return
            self._state = self._RUNNING
            engine.waiting -= 1
            engine.running += 1
        engine._update("vllm:num_requests_waiting", "increment", -1)
        engine._update("vllm:num_requests_running", "increment", 1)

    def tokens(self, n: int = 1) -> None:
        """`n` tokens came out now: the first call records the time to first token, later ones the
        inter-token latency (the gap since the previous call, once per token)."""
        if n <= 0 or self._state == self._DONE:
            return
        now = time.perf_counter()
        engine = self._engine
        if self.first_token is None:
            self.first_token = now
            engine._update("vllm:time_to_first_token_seconds", "observe", now - self.arrival)
            n -= 1
            self._last = now
            if n <= 0:
                return
        gap = (now - self._last) / n
        for _ in range(n):
            engine._update("vllm:inter_token_latency_seconds", "observe", gap)
        self._last = now

    def finished(self, prompt_tokens: int, generation_tokens: int, finish_reason: str) -> None:
        """The request ended (`finish_reason` "stop", "length" or "abort"): it leaves the gauges and its
        latency and token counts are recorded. A second call does nothing."""
        engine = self._engine
        with engine._lock:
            state = self._state
            if state == self._DONE:
                return
            self._state = self._DONE
            if state == self._WAITING:
                engine.waiting -= 1
            else:
                engine.running -= 1
        gauge = "vllm:num_requests_waiting" if state == self._WAITING else "vllm:num_requests_running"
        engine._update(gauge, "increment", -1)
        engine._update("vllm:e2e_request_latency_seconds", "observe", time.perf_counter() - self.arrival)
        engine._update("vllm:request_prompt_tokens", "observe", max(0, prompt_tokens))
        engine._update("vllm:request_generation_tokens", "observe", max(0, generation_tokens))
        engine._update("vllm:prompt_tokens_total", "increment", max(0, prompt_tokens))
        engine._update("vllm:generation_tokens_total", "increment", max(0, generation_tokens))
        engine._success_inc(finish_reason)
