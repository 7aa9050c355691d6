"""The scheduler protocol every model version's scheduler implements, and the factory that picks one from its config.

As in Triton core: the dynamic batch scheduler (`dynamic_batch`, also the default scheduler when the config has
no `dynamic_batching`), the sequence batch scheduler (`sequence_batch`) and the ensemble scheduler (`ensemble`).
"""

from __future__ import annotations

from typing import Protocol

from ..backends.base import ModelContext
from ..inference import InferenceRequest, InferenceResponse
from ..stats import ModelStats
from .dynamic_batch import DynamicBatchScheduler
from .ensemble import EnsembleScheduler
from .pool import InstancePool
from .sequence_batch import SequenceBatchScheduler


class Scheduler(Protocol):
    """What a model version hands its validated requests to."""

    stats: ModelStats  # where the scheduler records its requests and executions

    async def submit(self, request: InferenceRequest) -> InferenceResponse | None:
        """The request's response (None: a decoupled model answered through the request's callback)."""
        ...

    async def close(self, timeout: float | None = None) -> None:
        """Stop accepting requests; let queued and running ones finish, up to `timeout` seconds."""
        ...


def create_scheduler(ctx: ModelContext, pool: InstancePool | None, stats: ModelStats, server) -> Scheduler:
    """The scheduler `ctx.config` asks for: ensemble (no pool; `server` runs the steps), sequence batching,
    else dynamic batching or the default scheduler."""
    if ctx.config.platform == "ensemble":
        return EnsembleScheduler(ctx, stats, server)
    if pool is None:
        raise ValueError(f"model '{ctx.name}' needs instances to schedule on")
    if ctx.config.HasField("sequence_batching"):
        return SequenceBatchScheduler(pool, ctx.config, ctx.model_dir)
    return DynamicBatchScheduler(pool, ctx.config)
