"""Stand-in of vllm.outputs: RequestOutput and CompletionOutput as vLLM fills them, and the pooling outputs."""

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

_O = TypeVar("_O")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None = None
    stop_reason: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None
    lora_request: Any = None


@dataclass
class PoolingOutput:
    data: list[float]


@dataclass
class PoolingRequestOutput(Generic[_O]):
    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool


@dataclass
class EmbeddingOutput:
    embedding: list[float] = field(default_factory=list)

    @staticmethod
    def from_base(output: PoolingOutput) -> "EmbeddingOutput":
        return EmbeddingOutput(list(output.data))


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @staticmethod
    def from_base(output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return EmbeddingRequestOutput(
            output.request_id,
            EmbeddingOutput.from_base(output.outputs),
            output.prompt_token_ids,
            output.finished,
        )
