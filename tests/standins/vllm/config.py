"""Stand-in of vllm.config: the parts of VllmConfig that stat loggers and servers read."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    model: str
    max_model_len: int = 2048
    runner_type: str = "generate"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256


@dataclass
class VllmConfig:
    model_config: ModelConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora_config: Any = None  # vLLM's LoRAConfig when enable_lora; the stand-in keeps max_loras only
