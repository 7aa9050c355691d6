"""llm/vllm_request.py: the one reader of Triton vllm_backend's request shape (the llamacpp, vllm and transformers
backends all parse with it) and its response tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from naiad.errors import InvalidArgument
from naiad.inference import InferenceRequest
from naiad.llm import vllm_request


def _request(parameters: dict | None = None, **inputs) -> InferenceRequest:
    tensors = {}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            tensors[name] = value
        elif isinstance(value, bool):
            tensors[name] = np.array([value], dtype=np.bool_)
        else:
            data = value if isinstance(value, bytes) else str(value).encode()
            tensors[name] = np.array([data], dtype=np.object_)
    return InferenceRequest("m", tensors, {}, parameters=parameters or {})


def test_a_request_reads_into_python_values():
    req = vllm_request.parse(
        _request(
            text_input="Hello",
            sampling_parameters=json.dumps({"max_tokens": 3, "stop": ["x"]}),
            return_finish_reason=True,
            return_num_output_tokens=False,
        )
    )
    assert (req.prompt, req.stream, req.prepend_input) == ("Hello", False, True)
    assert req.sampling == {"max_tokens": 3, "stop": ["x"]}
    assert req.returns == {"return_finish_reason"}
    assert req.embedding is None and req.images == []
    streamed = vllm_request.parse(_request(text_input="Hi", stream=True))
    assert streamed.stream and not streamed.prepend_input
    kept = vllm_request.parse(_request(text_input="Hi", exclude_input_in_output=True))
    assert not kept.prepend_input


def test_sampling_parameters_come_from_the_request_parameters_without_the_tensor():
    """As vllm_backend reads them: the tensor when present, else the request's parameters (Triton's own dropped)."""
    parameters = {"max_tokens": 4, "temperature": 0, "triton_enable_empty_final_response": True}
    req = vllm_request.parse(_request(parameters, text_input="Hi"))
    assert req.sampling == {"max_tokens": 4, "temperature": 0}
    req = vllm_request.parse(_request(parameters, text_input="Hi", sampling_parameters='{"seed": 1}'))
    assert req.sampling == {"seed": 1}


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, "input 'text_input' is required"),
        ({"text_input": b"\xff\xfe"}, "input 'text_input' is not valid UTF-8"),
        ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one element"),
        ({"text_input": "Hi", "sampling_parameters": "{"}, "sampling_parameters is not valid JSON"),
        ({"text_input": "Hi", "sampling_parameters": "[1]"}, "sampling_parameters must be a JSON object"),
        ({"text_input": "Hi", "stream": True, "exclude_input_in_output": False}, "is not allowed"),
        ({"embedding_request": "{}"}, "needs an 'input'"),
    ],
)
def test_malformed_requests_are_invalid_arguments(inputs, message):
    with pytest.raises(InvalidArgument, match=message):
        vllm_request.parse(_request(**inputs))


def test_outputs_hold_what_the_request_asked_for():
    req = vllm_request.parse(
        _request(
            text_input="Hi",
            return_finish_reason=True,
            return_cumulative_logprob=True,
            return_logprobs=True,
            return_num_input_tokens=True,
        )
    )
    out = vllm_request.outputs(
        req, "ok", finish_reason="stop", cumulative_logprob=-1.5, logprobs=[{"7": {"logprob": -1.5}}],
        num_input_tokens=2, num_output_tokens=1,
    )  # fmt: skip
    assert set(out) == {"text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens"}
    assert out["text_output"][0] == b"ok" and out["finish_reason"][0] == b"stop"
    assert out["cumulative_logprob"][0] == np.float32(-1.5) and out["num_input_tokens"][0] == 2
    assert json.loads(out["logprobs"][0]) == [{"7": {"logprob": -1.5}}]
    assert set(vllm_request.outputs(vllm_request.parse(_request(text_input="Hi")), "ok")) == {"text_output"}
