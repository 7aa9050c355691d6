"""Traffic per variant of a model under a canary: the servers' own request counters (Triton's
`nv_inference_request_success` / `nv_inference_request_failure` on the metrics port), summed over the pods
that hold each variant, and their rates between two passes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aiohttp

from .metrics_text import sample_pattern, samples
from .naming import METRICS_PORT

_SAMPLE = sample_pattern(r"nv_inference_request_(?:success|failure)")


def parse_counters(text: str) -> dict[str, tuple[float, float]]:
    """Prometheus text -> {model: (successful requests, failed requests)}, summed over versions and reasons."""
    out: dict[str, list[float]] = {}
    for name, labels, value in samples(text, _SAMPLE):
        model = labels.get("model")
        if model is None:
            continue
        slot = out.setdefault(model, [0.0, 0.0])
        slot[0 if name.endswith("success") else 1] += value
    return {model: (ok, failed) for model, (ok, failed) in out.items()}


@dataclass
class VariantTraffic:
    requests: int
    failures: int
    request_rate: float | None  # per second since the previous reading; None on the first one
    failure_rate: float | None


class VariantMeter:
    """Reads the counters of pods and keeps the previous total per (namespace, model, revision) for rates."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        timeout: float,
        port: int = METRICS_PORT,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._port = port
        self._clock = clock
        self._previous: dict[tuple[str, str, str], tuple[float, float, float]] = {}

    async def scrape(self, ip: str) -> dict[str, tuple[float, float]] | None:
        host = f"[{ip}]" if ":" in ip else ip
        try:
            async with self._session.get(f"http://{host}:{self._port}/metrics", timeout=self._timeout) as r:
                if r.status != 200:
                    return None
                return parse_counters(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    async def scrape_all(self, ips: Iterable[str]) -> dict[str, dict[str, tuple[float, float]]]:
        ips = sorted(set(ips))
        readings = await asyncio.gather(*(self.scrape(ip) for ip in ips))
        return {ip: reading for ip, reading in zip(ips, readings) if reading is not None}

    def traffic(
        self,
        namespace: str,
        model: str,
        revision: str,
        counters: Iterable[tuple[float, float]],
    ) -> VariantTraffic:
        requests = failures = 0.0
        for ok, failed in counters:
            requests += ok + failed
            failures += failed
        now = self._clock()
        key = (namespace, model, revision)
        previous = self._previous.get(key)
        self._previous[key] = (now, requests, failures)
        request_rate = failure_rate = None
        if previous is not None and now > previous[0]:
            elapsed = now - previous[0]
            # A copy that restarted or moved starts from zero: a negative difference is no rate at all.
            request_rate = max(0.0, requests - previous[1]) / elapsed
            failure_rate = max(0.0, failures - previous[2]) / elapsed
        return VariantTraffic(int(requests), int(failures), request_rate, failure_rate)

    def forget(self, namespace: str, model: str, keep: Mapping[str, object] | Iterable[str] = ()) -> None:
        """Drop the readings of a model's revisions that are no longer variants."""
        keep = set(keep)
        for key in [k for k in self._previous if k[0] == namespace and k[1] == model and k[2] not in keep]:
            del self._previous[key]
