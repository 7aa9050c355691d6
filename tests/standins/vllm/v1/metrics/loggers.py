"""Stand-in of vllm.v1.metrics.loggers: the stat-logger interface an engine calls after each step."""

from collections.abc import Callable
from typing import Any


class StatLoggerBase:
    def __init__(self, vllm_config: Any, engine_index: int = 0):
        self.vllm_config = vllm_config
        self.engine_index = engine_index

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ):
        """Called after every engine step."""

    def log_engine_initialized(self) -> None:
        """Called once the engine is up."""

    def log(self) -> None:
        """Called periodically to print a summary."""


StatLoggerFactory = Callable[[Any, int], StatLoggerBase]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1
