"""Stand-in of vllm.engine.arg_utils.AsyncEngineArgs: a dataclass that refuses unknown arguments, as vLLM's does."""

from dataclasses import dataclass
from typing import Any

from vllm.config import ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig


@dataclass
class AsyncEngineArgs:
    model: str = "facebook/opt-125m"
    tokenizer: str | None = None
    runner: str = "auto"
    dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    trust_remote_code: bool = False
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    enable_prefix_caching: bool | None = None
    disable_log_stats: bool = False
    disable_log_requests: bool = True
    enable_log_requests: bool = False
    aggregate_engine_logging: bool = False

    def create_engine_config(self, usage_context: Any = None) -> VllmConfig:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be at least 1")
        runner = "pooling" if self.runner == "pooling" else "generate"
        return VllmConfig(
            model_config=ModelConfig(self.model, self.max_model_len or 2048, runner),
            parallel_config=ParallelConfig(
                self.tensor_parallel_size, self.pipeline_parallel_size, self.distributed_executor_backend
            ),
            scheduler_config=SchedulerConfig(self.max_num_seqs or 256),
            lora_config={"max_loras": self.max_loras} if self.enable_lora else None,
        )
