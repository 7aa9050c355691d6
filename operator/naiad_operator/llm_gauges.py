"""The LLM engines' own gauges read from a pod's metrics port (vLLM's names, labelled model_name, as the endpoint
picker reads them): requests waiting and running, KV-cache use and LoRA adapters per model, for the status of an
LLM InferenceModel's copies."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

from .metrics_text import sample_pattern, samples
from .naming import METRICS_PORT

_SAMPLE = sample_pattern(
    r"vllm:(?:num_requests_waiting|num_requests_running|kv_cache_usage_perc|lora_requests_info)"
)


@dataclass
class EngineGauges:
    """One model's gauges on one pod."""

    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float | None = None
    lora_adapters: list[str] = field(default_factory=list)
    _lora_time: float = -1.0


def parse_gauges(text: str) -> dict[str, EngineGauges]:
    """Prometheus text -> {model_name: gauges}; vllm:lora_requests_info's newest series names the adapters."""
    out: dict[str, EngineGauges] = {}
    for name, labels, value in samples(text, _SAMPLE):
        model = labels.get("model_name")
        if model is None:
            continue
        gauges = out.setdefault(model, EngineGauges())
        if name == "vllm:num_requests_waiting":
            gauges.waiting += value
        elif name == "vllm:num_requests_running":
            gauges.running += value
        elif name == "vllm:kv_cache_usage_perc":
            gauges.kv_cache_usage = max(gauges.kv_cache_usage or 0.0, value)
        elif value > gauges._lora_time:
            gauges._lora_time = value
            running = labels.get("running_lora_adapters", "")
            gauges.lora_adapters = [a for a in running.split(",") if a]
    return out


def copy_status(pod: str, gauges: EngineGauges | None) -> dict[str, object]:
    """One entry of status.copies: a pod holding the model and its queue and KV-cache use (figures absent when
    the pod's metrics could not be read)."""
    entry: dict[str, object] = {"pod": pod}
    if gauges is None:
        return entry
    entry["requestsWaiting"] = int(gauges.waiting)
    entry["requestsRunning"] = int(gauges.running)
    if gauges.kv_cache_usage is not None:
        entry["kvCacheUsagePercent"] = round(100 * gauges.kv_cache_usage, 1)
    if gauges.lora_adapters:
        entry["loraAdapters"] = list(gauges.lora_adapters)
    return entry


class GaugeReader:
    """Reads the gauges of pods over one aiohttp session (plain HTTP on the metrics port, as Prometheus does)."""

    def __init__(self, session: aiohttp.ClientSession, timeout: float, port: int = METRICS_PORT):
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._port = port

    async def read(self, ip: str) -> dict[str, EngineGauges] | None:
        host = f"[{ip}]" if ":" in ip else ip
        try:
            async with self._session.get(f"http://{host}:{self._port}/metrics", timeout=self._timeout) as r:
                if r.status != 200:
                    return None
                return parse_gauges(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    async def read_all(self, ips: Iterable[str]) -> dict[str, dict[str, EngineGauges]]:
        ips = sorted(set(ips))
        readings = await asyncio.gather(*(self.read(ip) for ip in ips))
        return {ip: reading for ip, reading in zip(ips, readings) if reading is not None}
