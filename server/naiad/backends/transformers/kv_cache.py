"""`vllm:kv_cache_usage_perc` for the transformers backend: the share of the paged KV cache of transformers'
continuous batching that live sequences hold, sampled from the manager's cache on the engine's loop thread.

The cache (`batch_processor.cache`, a `PagedAttentionCache`) is one tensor cut into sectors; each attention type's
allocator takes sectors from the pool and cuts them into blocks. Free are the pool's sectors, the blocks an
allocator holds that no sequence uses, and the complete blocks kept only for prefix sharing (the ledger's
`cached_blocks`, evicted when space runs out): vLLM counts its cached blocks as free too (`BlockPool.get_usage`),
so an idle engine reads 0, where transformers' own `compute_free_capacity` still counts them as used.

The sampler only reads counters (lengths of lists and dicts, a tree's leaf count) that the generation thread
updates, so it takes no lock and costs the generation nothing; a read that lands mid-step is off by that step's
allocation at most, and the next one is right. It samples every `BUSY_INTERVAL_S` while the engine has requests and
every `IDLE_INTERVAL_S` otherwise (the endpoint picker scrapes about every 50 ms).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ...llm.metrics import EngineMetrics

log = logging.getLogger("naiad.transformers")

BUSY_INTERVAL_S = 0.05
IDLE_INTERVAL_S = 0.5


def kv_cache_usage(cache: Any) -> float:
    """The fraction (0..1) of a transformers `PagedAttentionCache` that running sequences hold, in bytes."""
    bytes_per_sector = int(cache.bytes_per_sector)
    total = int(cache.num_sectors) * bytes_per_sector
    if total <= 0:
        return 0.0
    pool = cache.pool
    free = len(pool.free_sectors) * bytes_per_sector
    for allocator in tuple(cache.cache_allocators.values()):
        blocks = pool.count_free_blocks(allocator.index) + len(allocator.ledger.cached_blocks)
        free += blocks * int(allocator.bytes_per_block)
    return min(1.0, max(0.0, 1.0 - free / total))


class KVCacheSampler:
    """Sets `metrics`' KV-cache gauge from `manager`'s cache, on `loop` (timer callbacks, no task), until closed."""

    def __init__(self, manager: Any, metrics: EngineMetrics, loop: asyncio.AbstractEventLoop) -> None:
        self.manager = manager
        self.metrics = metrics
        self.loop = loop
        self.value: float | None = None  # the last value published
        self._closed = False

    def start(self) -> None:
        self.loop.call_soon_threadsafe(self._sample)

    def close(self) -> None:
        self._closed = True

    def _sample(self) -> None:
        if self._closed:
            return
        processor = getattr(self.manager, "batch_processor", None)
        cache = getattr(processor, "cache", None)
        if cache is not None:
            try:
                value = kv_cache_usage(cache)
            except (
                AttributeError,
                TypeError,
            ) as exc:  # a transformers version whose cache is laid out otherwise
                log.warning(
                    "model '%s': vllm:kv_cache_usage_perc is not reported: transformers' paged cache has no "
                    "counter read here (%s)",
                    self.metrics.model_name,
                    exc,
                )
                return
            if value != self.value:
                self.value = value
                self.metrics.set_kv_cache_usage(value)
        busy = self.metrics.running or self.metrics.waiting
        self.loop.call_later(BUSY_INTERVAL_S if busy else IDLE_INTERVAL_S, self._sample)
