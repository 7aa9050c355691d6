"""Stand-in of vllm.pooling_params."""

from dataclasses import dataclass


@dataclass
class PoolingParams:
    dimensions: int | None = None
    normalize: bool | None = None
    task: str | None = None
