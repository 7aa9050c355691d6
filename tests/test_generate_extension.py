"""Triton's generate extension as its `extension_generate.md` and HTTP server define it: keys mapped to inputs or
parameters, inputs shaped to the model's dims, every output (and response parameter) a top-level key, SSE without an
end marker, the first response deciding the status, and Triton's error wording."""

from __future__ import annotations

import json
import textwrap
import time

import pytest
import requests
from helpers import NaiadProcess

MOCK_LLM = """
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            count = params.get("REPETITION", 1)
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            stream = bool(pb_utils.get_input_tensor_by_name(request, "STREAM").as_numpy().reshape(-1)[0])
            value = np.array([], dtype=object) if params.get("OUTPUT_0_DIM") else prompt
            response = pb_utils.InferenceResponse(
                [pb_utils.Tensor("TEXT", value)], parameters={"shape": str(list(prompt.shape)), "n": 7}
            )
            if not stream:
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            for _ in range(count):
                if params.get("DELAY"):
                    time.sleep(params["DELAY"])
                if sender.is_cancelled():
                    break
                sender.send(response)
            last = pb_utils.InferenceResponse(error=pb_utils.TritonError("An Error Occurred")) if params.get(
                "FAIL_LAST") else None
            sender.send(last, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

CONFIG = """
name: "mock_llm"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "PROMPT" data_type: TYPE_STRING dims: [ 1, 1 ] },
  { name: "STREAM" data_type: TYPE_BOOL dims: [ 1, 1 ] },
  { name: "input_ids" data_type: TYPE_INT32 dims: [ 1, -1 ] optional: true }
]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1, -1 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("generate") / "models"
    (repo / "mock_llm" / "1").mkdir(parents=True)
    (repo / "mock_llm" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    (repo / "mock_llm" / "1" / "model.py").write_text(MOCK_LLM)
    with NaiadProcess(repo, "--allow-grpc", "false") as proc:
        yield proc


def generate(server, body, streaming=False, **kw) -> requests.Response:
    path = "generate_stream" if streaming else "generate"
    data = body if isinstance(body, str) else json.dumps(body)
    return requests.post(f"{server.url}/v2/models/mock_llm/{path}", data=data, **kw)


def sse(r: requests.Response) -> list[dict]:
    assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    blocks = r.text.split("\n\n")
    assert blocks[-1] == ""  # every event ends with a blank line, and nothing (no [DONE]) follows the last
    return [json.loads(b[len("data: ") :]) for b in blocks[:-1] if b.startswith("data: ") or pytest.fail(b)]


def expect_failure(server, body, message: str) -> None:
    for stream in (False, True):
        r = generate(server, body, stream)
        assert r.status_code == 400, r.text
        assert r.headers["Content-Type"] == "application/json"
        assert message in r.json()["error"], r.json()


def test_generate_maps_scalars_to_the_model_dims(server):
    r = generate(server, {"PROMPT": "hello world", "STREAM": False})
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    doc = r.json()
    assert doc["TEXT"] == "hello world" and doc["model_name"] == "mock_llm" and doc["model_version"] == "1"
    assert doc["shape"] == "[1, 1]" and doc["n"] == 7  # response parameters are top-level keys too
    assert "id" not in doc
    assert generate(server, {"PROMPT": "x", "STREAM": False, "id": "42"}).json()["id"] == "42"
    assert "id" not in generate(server, {"PROMPT": "x", "STREAM": False, "id": ""}).json()


def test_generate_stream_is_sse_without_an_end_marker(server):
    r = generate(server, {"PROMPT": ["hi"], "STREAM": True, "parameters": {"REPETITION": 3}}, True)
    assert r.status_code == 200
    assert [e["TEXT"] for e in sse(r)] == ["hi"] * 3


def test_responses_ready_together_go_out_in_one_write(server):
    """A model that sends faster than the event loop writes: the responses waiting behind one go out with it, in
    one HTTP chunk (one send, one wakeup of the client), every event whole and in order."""
    body = {"PROMPT": ["hi"], "STREAM": True, "parameters": {"REPETITION": 400}}
    with generate(server, body, True, stream=True) as r:
        assert r.status_code == 200
        chunks = list(r.raw.read_chunked(decode_content=False))
    assert all(c.endswith(b"\n\n") for c in chunks)  # events are never split across writes
    events = b"".join(chunks).split(b"\n\n")[:-1]
    assert [json.loads(e[len(b"data: ") :])["TEXT"] for e in events] == ["hi"] * 400
    assert max(c.count(b"data: ") for c in chunks) > 1, f"{len(chunks)} chunks for 400 events"


def test_parameters_may_carry_inputs(server):
    r = generate(server, {"PROMPT": "hi", "parameters": {"STREAM": True, "REPETITION": 2}}, True)
    assert [e["TEXT"] for e in sse(r)] == ["hi"] * 2


def test_first_response_sets_the_status(server):
    body = {"PROMPT": "hi", "STREAM": True, "REPETITION": 0, "FAIL_LAST": True}
    r = generate(server, body, True)
    assert r.status_code == 500 and sse(r) == [{"error": "An Error Occurred"}]
    body["REPETITION"] = 1
    r = generate(server, body, True)
    assert r.status_code == 200
    events = sse(r)
    assert events[0]["TEXT"] == "hi" and events[1] == {"error": "An Error Occurred"}


def test_generate_wants_exactly_one_response(server):
    for count in (0, 2):
        r = generate(server, {"PROMPT": "hi", "STREAM": True, "REPETITION": count})
        assert (
            r.status_code == 400
            and "generate expects model to produce exactly 1 response" in r.json()["error"]
        )
    assert generate(server, {"PROMPT": "hi", "STREAM": True}).status_code == 200  # one, then the final flag


def test_zero_dimension_output(server):
    r = generate(server, {"PROMPT": "hi", "STREAM": False, "OUTPUT_0_DIM": True})
    assert r.status_code == 200 and r.json()["TEXT"] == []


def test_triton_error_wording(server):
    expect_failure(server, {"PROMPT": 123, "STREAM": False}, "attempt to access JSON non-string as string")
    expect_failure(
        server, {"PROMPT": "hi", "STREAM": "false"}, "attempt to access JSON non-boolean as boolean"
    )
    expect_failure(server, '{"PROMPT": "a", "STREAM": false, "PROMPT": "b"}', "input 'PROMPT' already exists")
    expect_failure(
        server, {"PROMPT": "hi", "STREAM": True, "PARAMS": {"a": 1}}, "parameter 'PARAMS' has invalid type"
    )
    expect_failure(
        server, {"PROMPT": "hi", "STREAM": True, "parameters": 1}, "Expected JSON object for keyword"
    )
    expect_failure(
        server,
        {"PROMPT": "hi", "STREAM": True, "parameters": {"nested": {"twice": 1}}},
        "Converting keyword: 'parameters': parameter 'nested' has invalid type.",
    )
    expect_failure(server, {"STREAM": False, "other": "param"}, "expected 2 inputs but got 1")
    expect_failure(
        server,
        {"PROMPT": ["a", "b"], "STREAM": False},
        "The schema can not convert input 'PROMPT' to tensor with proper shape",
    )


def test_close_during_streaming_leaves_the_server_healthy(server):
    body = {"PROMPT": "hi", "STREAM": True, "REPETITION": 3, "DELAY": 0.5}
    with generate(server, body, True, stream=True) as r:
        assert r.status_code == 200
    time.sleep(0.2)
    assert requests.get(f"{server.url}/v2/health/live").status_code == 200
    assert generate(server, {"PROMPT": "x", "STREAM": False}).status_code == 200
