"""Stand-in of vllm.v1.metrics.stats: what the engine hands its stat loggers after each step."""

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


@dataclass
class IterationStats:
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    n_params_iter: list[int] = field(default_factory=list)


@dataclass
class MultiModalCacheStats:
    hits: int = 0
    queries: int = 0
