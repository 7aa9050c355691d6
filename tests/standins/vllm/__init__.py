"""Stand-in for vLLM's API surface (tests only, see tests/standins/README.md): no model, a word-echo engine."""

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.0.0+naiad.standin"
__all__ = [
    "AsyncEngineArgs",
    "CompletionOutput",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
