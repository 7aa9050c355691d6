"""Stand-in of vllm.sampling_params: SamplingParams with vLLM's field names, types and defaults."""

# typing.Optional as vLLM spells it: callers compare SamplingParams.__annotations__ with Optional[int]
# ruff: noqa: UP045

import enum
from dataclasses import dataclass
from typing import Any, Optional


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingParams:
    """Keyword arguments only, unknown ones refused (TypeError), as vLLM's msgspec struct."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Any] = None
    stop_token_ids: Optional[list] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __init__(self, **kwargs: Any):
        for key, value in kwargs.items():
            if not hasattr(type(self), key):
                raise TypeError(f"SamplingParams got an unexpected keyword argument '{key}'")
            setattr(self, key, value)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is not None and int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if float(self.temperature) < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")

    def __repr__(self) -> str:
        return f"SamplingParams(n={self.n}, temperature={self.temperature}, max_tokens={self.max_tokens})"
