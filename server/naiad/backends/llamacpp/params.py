"""The llamacpp backend's settings: config.pbtxt parameters of the model and vLLM `sampling_parameters` of a request."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import InvalidArgument
from ...llm.vllm_request import stop_strings
from .grammar import structured_grammar
from .rpc import RPC_SERVERS_ENV, parse_rpc_servers

# config.pbtxt `parameters { key: ... value: { string_value: ... } }`: name -> (default, help)
MODEL_PARAMETERS = {
    "n_ctx": (2048, "context (tokens) of each sequence: prompt plus generated tokens"),
    "n_parallel": (4, "slots: sequences decoded together in one batch (continuous batching)"),
    "n_threads": (0, "CPU threads for decoding (0: the cores this process may use, shared by the instances)"),
    "n_batch": (512, "most tokens in one llama_decode call (prompt chunks and decode tokens together)"),
    "embeddings": ("true", "serve `embedding_request` with mean pooling from a second context"),
    "rpc_servers": (
        "",
        "llama.cpp `rpc-server`s (host:port,...; or env:<VARIABLE>) the layers are offloaded to; empty: "
        "$NAIAD_LLAMACPP_RPC_SERVERS, else none",
    ),
    "rpc_wait_seconds": (120, "how long a load waits for the RPC servers to answer (workers still starting)"),
    "lora_adapters": (
        "",
        "LoRA adapters loaded with the model (name=path,name2=path2; a path relative to the version folder); a "
        "request names one by sampling parameter lora_name, an OpenAI request by model; multi_lora.json in the "
        "version folder (Triton vllm_backend's: {name: path}) adds to them",
    ),
    "mmproj": (
        "",
        "the multimodal projector GGUF (llama.cpp's mmproj: a vision encoder and its projection) for images in "
        "requests (a path relative to the version folder); empty: mmproj.gguf in the version folder when there is "
        "one, else a text-only model",
    ),
    "max_prompt_bytes": (
        0,
        "prompts of more UTF-8 bytes are refused untokenized (0: n_ctx times the vocabulary's longest token, the "
        "most any tokenization of n_ctx tokens can hold; a smaller value lowers that bound)",
    ),
    # speculative decoding (speculative.py)
    "speculative_model": (
        "",
        "a draft GGUF (a path relative to the version folder) sharing the model's vocabulary: it proposes "
        "speculative_max tokens per step that the model verifies in its own decode; empty: none",
    ),
    "speculative_ngram": (
        0,
        "prompt-lookup drafting without a draft model (vLLM's ngram): the last N tokens are looked up in the "
        "sequence's prompt and output and what followed them is proposed; 0: off",
    ),
    "speculative_ngram_min": (
        0,
        "the shortest n-gram prompt lookup matches when the last speculative_ngram tokens match nowhere "
        "(0: speculative_ngram, as vLLM's prompt_lookup_min)",
    ),
    "speculative_max": (4, "most draft tokens per sequence and step (vLLM's num_speculative_tokens)"),
    "speculative_min": (0, "a shorter draft is not verified (llama.cpp's --draft-min)"),
    "speculative_p_min": (
        "0",
        "the draft model stops drafting at a token it gives less probability than this (llama.cpp's "
        "--draft-p-min; 0: always speculative_max tokens)",
    ),
}


@dataclass
class EngineSettings:
    n_ctx: int = 2048
    n_parallel: int = 4
    n_threads: int = 0
    n_batch: int = 512
    embeddings: bool = True
    rpc_servers: list[str] = field(default_factory=list)
    rpc_wait_seconds: int = 120
    max_prompt_bytes: int = 0  # 0: the bound the vocabulary gives (llm/limits.py)
    speculative_model: str = (
        ""  # the draft GGUF's path (resolved against the version folder by engine_settings)
    )
    speculative_ngram: int = 0
    speculative_ngram_min: int = 0
    speculative_max: int = 4
    speculative_min: int = 0
    speculative_p_min: float = 0.0


_MAY_BE_ZERO = (
    "n_threads",
    "rpc_wait_seconds",
    "max_prompt_bytes",
    "speculative_ngram",
    "speculative_ngram_min",
    "speculative_min",
)


def engine_settings(
    parameters: dict[str, str], instance_count: int = 1, version_dir: Path | None = None
) -> EngineSettings:
    """The engine settings from a config's parameters; unknown or malformed values are a load error. A relative
    `speculative_model` is taken from `version_dir` (the model's version folder), and must be a file there."""
    out = EngineSettings()
    rpc = parameters.get("rpc_servers") or os.environ.get(RPC_SERVERS_ENV, "")
    out.rpc_servers = parse_rpc_servers(rpc)
    for key, raw in parameters.items():
        if key in ("rpc_servers", "lora_adapters", "mmproj"):
            continue  # (lora_adapters: lora.py; mmproj: multimodal.py)
        if key not in MODEL_PARAMETERS:
            continue  # other backends' or the user's own keys are left alone, as Triton does
        if key == "embeddings":
            if raw.lower() not in ("true", "false", "1", "0"):
                raise InvalidArgument(f"parameter 'embeddings' must be true or false, got {raw!r}")
            out.embeddings = raw.lower() in ("true", "1")
            continue
        if key == "speculative_model":
            out.speculative_model = _draft_path(raw.strip(), version_dir)
            continue
        if key == "speculative_p_min":
            try:
                out.speculative_p_min = float(raw)
            except ValueError:
                raise InvalidArgument(f"parameter '{key}' must be a number, got {raw!r}") from None
            if not 0.0 <= out.speculative_p_min <= 1.0:
                raise InvalidArgument(f"parameter '{key}' must be in [0, 1], got {raw}")
            continue
        try:
            value = int(raw)
        except ValueError:
            raise InvalidArgument(f"parameter '{key}' must be an integer, got {raw!r}") from None
        if value < (0 if key in _MAY_BE_ZERO else 1):
            raise InvalidArgument(f"parameter '{key}' must be positive, got {value}")
        setattr(out, key, value)
    if out.speculative_ngram and out.speculative_ngram_min > out.speculative_ngram:
        raise InvalidArgument(
            f"parameter 'speculative_ngram_min' ({out.speculative_ngram_min}) is more than 'speculative_ngram' "
            f"({out.speculative_ngram})"
        )
    if out.speculative_min > out.speculative_max:
        raise InvalidArgument(
            f"parameter 'speculative_min' ({out.speculative_min}) is more than 'speculative_max' "
            f"({out.speculative_max})"
        )
    if out.n_threads == 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        out.n_threads = max(1, cores // max(1, instance_count))
    return out


def _draft_path(raw: str, version_dir: Path | None) -> str:
    if not raw:
        return ""
    path = Path(raw).expanduser()
    if not path.is_absolute() and version_dir is not None:
        path = version_dir / path
    if version_dir is not None and not path.is_file():
        raise InvalidArgument(f"parameter 'speculative_model': no draft GGUF at '{raw}' (from {version_dir})")
    return str(path)


@dataclass
class SamplingParams:
    """The subset of vLLM's SamplingParams this engine honours."""

    max_tokens: int | None = None  # None: vLLM's default of 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    grammar: str | None = None  # GBNF the output must follow (from `structured_outputs`, see grammar.py)
    lora_name: str | None = None  # the LoRA adapter to decode under (Triton vllm_backend's `lora_name`)
    lora_scale: float = 1.0  # its scale (llama.cpp's; 0: the base model)


def _number(params: dict, key: str, kind: type, low: float | None = None, high: float | None = None) -> Any:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidArgument(f"sampling parameter '{key}' must be a number, got {value!r}")
    try:
        value = kind(value) if kind is float else int(float(value))
    except ValueError:
        raise InvalidArgument(f"sampling parameter '{key}' must be a number, got {value!r}") from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidArgument(f"sampling parameter '{key}' must be in [{low}, {high}], got {value}")
    return value


def sampling_params(params: dict[str, Any]) -> SamplingParams:
    """The engine's sampling parameters from a vLLM-shape request's (llm/vllm_request.py parsed its JSON); bad
    values are InvalidArgument."""
    out = SamplingParams()
    if "n" in params and params["n"] not in (1, "1", None):
        raise InvalidArgument("the llamacpp backend generates one sequence per request: 'n' must be 1")
    if params.get("best_of") not in (None, 1, "1"):
        raise InvalidArgument("the llamacpp backend does not support 'best_of' (beam search)")
    if params.get("max_tokens") is not None:
        out.max_tokens = _number(params, "max_tokens", int, 1)
    if params.get("temperature") is not None:
        out.temperature = _number(params, "temperature", float, 0.0)
    if params.get("top_p") is not None:
        out.top_p = _number(params, "top_p", float, 0.0, 1.0)
        if out.top_p == 0.0:
            raise InvalidArgument("sampling parameter 'top_p' must be in (0, 1], got 0")
    if params.get("top_k") is not None:
        out.top_k = _number(params, "top_k", int, -1)
    if params.get("min_p") is not None:
        out.min_p = _number(params, "min_p", float, 0.0, 1.0)
    if params.get("seed") is not None:
        out.seed = _number(params, "seed", int) & 0xFFFFFFFF
    if params.get("min_tokens") is not None:
        out.min_tokens = _number(params, "min_tokens", int, 0)
    if params.get("logprobs") is not None:
        out.logprobs = _number(params, "logprobs", int, 0, 20)
    lora = params.get("lora_name")
    if lora is not None:
        if not isinstance(lora, str) or not lora:
            raise InvalidArgument("sampling parameter 'lora_name' must be a non-empty string")
        out.lora_name = lora
    if params.get("lora_scale") is not None:
        out.lora_scale = _number(params, "lora_scale", float, -16.0, 16.0)
    ignore = params.get("ignore_eos", False)
    out.ignore_eos = ignore in (True, "true", "True", 1)
    if params.get("stop") is not None:
        out.stop = stop_strings(params)
    out.grammar = structured_grammar(params.get("structured_outputs"))
    if out.grammar is not None and (out.ignore_eos or out.min_tokens > 0):
        # the grammar ends the output by allowing only end-of-generation tokens, which these would ban
        raise InvalidArgument("'structured_outputs' cannot be combined with 'ignore_eos' or 'min_tokens'")
    return out


def context_params(lc, settings: EngineSettings):
    """llama.cpp's context parameters for an engine of `settings` (the model's and a draft model's alike)."""
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = settings.n_ctx * settings.n_parallel
    cparams.n_batch = settings.n_batch
    cparams.n_ubatch = settings.n_batch
    cparams.n_seq_max = settings.n_parallel
    cparams.n_threads = settings.n_threads
    cparams.n_threads_batch = settings.n_threads
    cparams.kv_unified = False  # every sequence owns n_ctx cells: a slot can never run out of KV cache
    # a sliding-window model's (gemma2/3) cache holds every position too, not only the window: prefix reuse keeps
    # a prompt's first tokens, whose window a smaller SWA cache would have overwritten (llama.cpp's default)
    cparams.swa_full = True
    cparams.no_perf = True
    return cparams
