"""The tensors an LLM model takes and returns, in the shapes Triton's LLM backends define.

The vLLM shape is Triton's vllm_backend's (`text_input`, `stream`, `sampling_parameters` as JSON, ...; `text_output`
back). Native engines auto-complete a bare `backend: "..."` config to it, as the vLLM backend does, so one client
request works against any of them.
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

# (name, data type, dims, optional): the order and types of Triton's vllm_backend auto-complete.
VLLM_INPUTS: tuple[tuple[str, int, tuple[int, ...], bool], ...] = (
    ("text_input", mc.TYPE_STRING, (1,), False),
    # images, one base64 string each (PNG, JPEG, WebP, GIF), placed where the prompt has the model's image marker
    ("image", mc.TYPE_STRING, (-1,), True),
    ("stream", mc.TYPE_BOOL, (1,), True),
    ("sampling_parameters", mc.TYPE_STRING, (1,), True),
    ("exclude_input_in_output", mc.TYPE_BOOL, (1,), True),
    ("return_finish_reason", mc.TYPE_BOOL, (1,), True),
    ("return_cumulative_logprob", mc.TYPE_BOOL, (1,), True),
    ("return_logprobs", mc.TYPE_BOOL, (1,), True),
    ("return_num_input_tokens", mc.TYPE_BOOL, (1,), True),
    ("return_num_output_tokens", mc.TYPE_BOOL, (1,), True),
    # {"input": str | [token ids], "pooling_params": {"dimensions": [d]}}; the embedding comes back in
    # `text_output` as a JSON list of floats (vllm_backend's EmbedRequest)
    ("embedding_request", mc.TYPE_STRING, (1,), True),
)
VLLM_OUTPUTS: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("text_output", mc.TYPE_STRING, (-1,)),
    ("finish_reason", mc.TYPE_STRING, (-1,)),
    ("cumulative_logprob", mc.TYPE_FP32, (-1,)),
    ("logprobs", mc.TYPE_STRING, (-1,)),
    ("num_input_tokens", mc.TYPE_UINT32, (1,)),
    ("num_output_tokens", mc.TYPE_UINT32, (-1,)),
)

# The TensorRT-LLM shape (tensorrtllm_backend's ensemble / tensorrt_llm_bls inputs): text in, text out, the sampling
# settings as tensors of their own. Only `text_input` and `text_output` are required of a model in this shape.
TRTLLM_INPUTS = (
    "text_input",
    "max_tokens",
    "bad_words",
    "stop_words",
    "end_id",
    "pad_id",
    "top_k",
    "top_p",
    "temperature",
    "length_penalty",
    "repetition_penalty",
    "min_length",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "return_log_probs",
    "beam_width",
    "stream",
    "exclude_input_in_output",
)


def is_vllm_shape(config: mc.ModelConfig) -> bool:
    """A model takes vLLM-shape requests when it has `text_input` and `sampling_parameters` inputs."""
    names = {i.name for i in config.input}
    return {"text_input", "sampling_parameters"} <= names


def is_trtllm_shape(config: mc.ModelConfig) -> bool:
    """A model in the TensorRT-LLM shape: `text_input` and `max_tokens` in, `text_output` out."""
    names = {i.name for i in config.input}
    return {"text_input", "max_tokens"} <= names and any(o.name == "text_output" for o in config.output)


def auto_complete_vllm_shape(config: mc.ModelConfig) -> None:
    """Add the vLLM shape's inputs and outputs a config lacks, make it decoupled and unbatched (the engine
    batches its own sequences), as Triton's vllm_backend does for a bare config."""
    have = {i.name for i in config.input}
    for name, dtype, dims, optional in VLLM_INPUTS:
        if name not in have:
            config.input.add(name=name, data_type=dtype, dims=list(dims), optional=optional)
    have = {o.name for o in config.output}
    for name, dtype, dims in VLLM_OUTPUTS:
        if name not in have:
            config.output.add(name=name, data_type=dtype, dims=list(dims))
    config.model_transaction_policy.decoupled = True
    config.max_batch_size = 0
