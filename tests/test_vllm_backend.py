"""Naiad's own `backend: "vllm"` on Triton's layout (bare config.pbtxt, `1/model.json`), driven over HTTP generate and
a gRPC stream. On CPU it runs against the stand-in `vllm` package (tests/standins: vLLM's API surface, not its
behaviour), as vllm_backend's CI mocks the engine; the test marked `gpu` runs real vLLM on a tiny llama built here.
A `--backend-directory` with `vllm/model.py` takes precedence over the built-in."""

from __future__ import annotations

import json
import os
import queue
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from helpers import ROOT, NaiadProcess

STANDINS = ROOT / "tests" / "standins"


def write_model(repo: Path, name: str, engine_args: dict, extra: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text('backend: "vllm"\n' + extra)
    (repo / name / "1" / "model.json").write_text(json.dumps(engine_args))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_native")
    shutil.copytree(STANDINS / "vllm", tmp / "site" / "vllm")
    repo = tmp / "models"
    write_model(repo, "llm", {"model": "stand-in", "tensor_parallel_size": 1, "max_num_seqs": 2})
    write_model(repo, "embedder", {"model": "stand-in", "runner": "pooling"})
    write_model(repo, "bad_args", {"model": "stand-in", "no_such_argument": 1})
    env = {"PYTHONPATH": f"{ROOT / 'server'}:{tmp / 'site'}"}
    with NaiadProcess(repo, "--strict-readiness", "false", env=env, timeout=120) as proc:
        yield proc


def generate(server, model: str, body: dict) -> requests.Response:
    return requests.post(f"{server.url}/v2/models/{model}/generate", json=body, timeout=30)


def test_bare_config_and_bad_engine_arguments(server):
    config = requests.get(f"{server.url}/v2/models/llm/config").json()
    assert config["model_transaction_policy"]["decoupled"] is True and config["max_batch_size"] == 0
    assert "embedding_request" in {i["name"] for i in config["input"]}
    index = {m["name"]: m for m in requests.post(f"{server.url}/v2/repository/index").json()}
    assert index["bad_args"]["state"] == "UNAVAILABLE" and "no_such_argument" in index["bad_args"]["reason"]


def test_generate_with_the_additional_outputs(server):
    body = {
        "text_input": "one two three",
        "sampling_parameters": json.dumps({"max_tokens": 4, "logprobs": 1}),
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_cumulative_logprob": True,
        "return_logprobs": True,
    }
    answer = generate(server, "llm", body).json()
    assert answer["text_output"] == " three two one three"
    assert answer["finish_reason"] == "length"
    assert answer["num_input_tokens"] == 3 and answer["num_output_tokens"] == 4
    assert answer["cumulative_logprob"] == -2.0 and len(json.loads(answer["logprobs"])) == 4
    # request parameters are the sampling parameters when the tensor is absent; the prompt is prepended
    answer = generate(server, "llm", {"text_input": "a b", "parameters": {"max_tokens": 2}}).json()
    assert answer["text_output"] == "a b b a"


def test_stream_deltas_and_stop(server):
    r = requests.post(
        f"{server.url}/v2/models/llm/generate_stream",
        json={"text_input": "x y z", "stream": True, "sampling_parameters": json.dumps({"max_tokens": 5})},
        stream=True,
        timeout=30,
    )
    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert [e["text_output"] for e in events] == [" z", " y", " x", " z", " y"]
    body = {
        "text_input": "x y z",
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "sampling_parameters": json.dumps({"max_tokens": 6, "stop": ["x z"]}),
    }
    answer = generate(server, "llm", body).json()
    assert answer["text_output"] == " z y " and answer["finish_reason"] == "stop"


def test_bad_sampling_parameters_are_400(server):
    r = generate(server, "llm", {"text_input": "a", "sampling_parameters": json.dumps({"no_such": 1})})
    assert r.status_code == 400 and "no_such" in r.json()["error"]
    r = generate(server, "llm", {"text_input": "a", "sampling_parameters": "[1]"})
    assert r.status_code == 400


def test_embeddings_on_a_pooling_model_only(server):
    body = {
        "text_input": "",
        "embedding_request": json.dumps({"input": "a b", "pooling_params": {"dimensions": [4]}}),
    }
    answer = generate(server, "embedder", body)
    assert answer.status_code == 200, answer.text
    assert len(json.loads(answer.json()["text_output"])) == 4
    assert generate(server, "llm", body).status_code == 400
    assert generate(server, "embedder", {"text_input": "a"}).status_code == 400


def metric(server, name: str) -> float:
    for line in requests.get(f"http://{server.metrics}/metrics").text.splitlines():
        if line.startswith(name + '{model_name="llm"}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is missing from /metrics")


def test_cancel_aborts_and_the_gauges_follow(server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tensors = []
    for name, dtype, value in (
        ("text_input", "BYTES", np.array([b"w"], dtype=object)),
        ("stream", "BOOL", np.array([True])),
        (
            "sampling_parameters",
            "BYTES",
            np.array([json.dumps({"max_tokens": 100000}).encode()], dtype=object),
        ),
    ):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(value)
        tensors.append(t)
    for i in range(3):  # max_num_seqs 2: the third waits
        client.async_stream_infer("llm", tensors, request_id=f"long{i}")
    for _ in range(3):
        _, error = results.get(timeout=20)
        assert error is None
    deadline = time.monotonic() + 10
    while metric(server, "vllm:num_requests_waiting") != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "vllm:num_requests_running") == 2
    assert metric(server, "vllm:num_requests_waiting") == 1
    assert metric(server, "vllm:kv_cache_usage_perc") == 1.0  # the stand-in: running / max_num_seqs
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 10
    while metric(server, "vllm:num_requests_running") + metric(server, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "the cancelled requests still hold the engine"
        time.sleep(0.05)
    assert server.output().count("vllm stand-in: aborted request") >= 2


def test_lora_adapters_from_multi_lora_json(tmp_path):
    """Triton vllm_backend's LoRA: `enable_lora` in model.json and multi_lora.json beside it; `lora_name` in the
    sampling parameters reaches the engine as a LoRARequest (the stand-in writes the adapter's name on every word),
    with vllm_backend's errors; the OpenAI API lists each adapter as a model whose parent is the base and serves it
    by name; vllm:lora_requests_info lists the adapters of the requests in the engine. enable_lora without
    multi_lora.json fails the load."""
    shutil.copytree(STANDINS / "vllm", tmp_path / "site" / "vllm")
    repo = tmp_path / "models"
    write_model(repo, "base", {"model": "stand-in", "enable_lora": True, "max_loras": 2})
    (repo / "base" / "1" / "multi_lora.json").write_text(
        json.dumps({"sql": "adapters/sql", "chat": "/abs/chat"})
    )
    write_model(repo, "plain", {"model": "stand-in"})
    write_model(repo, "no_file", {"model": "stand-in", "enable_lora": "true"})
    env = {"PYTHONPATH": f"{ROOT / 'server'}:{tmp_path / 'site'}"}
    with NaiadProcess(repo, "--strict-readiness", "false", env=env, timeout=120) as server:
        body = {"text_input": "a b", "exclude_input_in_output": True}

        def run(model: str, **sampling) -> requests.Response:
            params = json.dumps({"max_tokens": 2, **sampling})
            return generate(server, model, {**body, "sampling_parameters": params})

        assert run("base").json()["text_output"] == " b a"
        assert run("base", lora_name="sql").json()["text_output"] == " sql:b sql:a"
        r = run("base", lora_name="nope")
        assert r.status_code == 400
        assert r.json()["error"] == "LoRA nope is not supported, we currently support ['sql', 'chat']"
        r = run("plain", lora_name="sql")
        assert r.status_code == 400 and r.json()["error"] == "LoRA feature is not enabled."
        index = {m["name"]: m for m in requests.post(f"{server.url}/v2/repository/index").json()}
        assert index["no_file"]["state"] == "UNAVAILABLE" and "multi_lora.json" in index["no_file"]["reason"]
        cards = {m["id"]: m for m in requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
        assert cards["sql"]["parent"] == "base" and cards["chat"]["parent"] == "base"
        r = requests.post(
            f"{server.url}/v1/completions",
            json={"model": "chat", "prompt": "x y", "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["model"] == "chat", r.text
        assert r.json()["choices"][0]["text"] == " chat:y chat:x"

        def lora_info() -> str:
            text = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
            (line,) = [
                line
                for line in text.splitlines()
                if line.startswith("vllm:lora_requests_info{") and 'model_name="base"' in line
            ]
            return line

        stream = requests.post(  # 300 tokens at the stand-in's 10 ms a step: running while it is read
            f"{server.url}/v2/models/base/generate_stream",
            json={
                **body,
                "stream": True,
                "sampling_parameters": json.dumps({"max_tokens": 300, "lora_name": "sql"}),
            },
            stream=True,
            timeout=30,
        )
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))
        assert 'running_lora_adapters="sql"' in lora_info() and 'max_lora="2"' in lora_info()
        stream.close()
        deadline = time.monotonic() + 10
        while 'running_lora_adapters=""' not in lora_info():
            assert time.monotonic() < deadline, lora_info()
            time.sleep(0.1)


def test_backend_directory_takes_precedence(tmp_path):
    shutil.copytree(STANDINS / "vllm", tmp_path / "site" / "vllm")
    (tmp_path / "backends" / "vllm").mkdir(parents=True)
    (tmp_path / "backends" / "vllm" / "model.py").write_text(
        "import numpy as np\nimport triton_python_backend_utils as pb_utils\n\n\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('text_output', np.array([b'from model.py'], "
        "dtype=object))]) for _ in requests]\n"
    )
    repo = tmp_path / "models"
    write_model(
        repo,
        "llm",
        {"model": "stand-in"},
        'input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]\n',
    )
    env = {"PYTHONPATH": f"{ROOT / 'server'}:{tmp_path / 'site'}"}
    with NaiadProcess(repo, "--backend-directory", str(tmp_path / "backends"), env=env) as proc:
        assert generate(proc, "llm", {"text_input": "a"}).json()["text_output"] == "from model.py"


def test_config_parameters_override_the_parallel_sizes(tmp_path):
    """What the operator sends for `llm.parallelism: {tensor: 2}`: a config override with the parallel sizes as
    parameters and KIND_MODEL; the engine gets them over model.json's, which stays as it is."""
    shutil.copytree(STANDINS / "vllm", tmp_path / "site" / "vllm")
    repo = tmp_path / "models"
    write_model(repo, "llm", {"model": "stand-in", "tensor_parallel_size": 1})
    env = {"PYTHONPATH": f"{ROOT / 'server'}:{tmp_path / 'site'}"}

    def load(parameters: dict | None) -> requests.Response:
        config = {"backend": "vllm", "instance_group": [{"kind": "KIND_MODEL"}], "parameters": parameters}
        body = {"parameters": {"config": json.dumps(config)}} if parameters is not None else {}
        return requests.post(f"{proc.url}/v2/repository/models/llm/load", json=body, timeout=60)

    with NaiadProcess(repo, "--model-control-mode", "explicit", env=env) as proc:
        assert load(None).status_code == 200
        assert "engine for stand-in with tensor_parallel_size=1 pipeline_parallel_size=1" in proc.output()
        r = load(
            {"tensor_parallel_size": {"string_value": "2"}, "pipeline_parallel_size": {"string_value": "1"}}
        )
        assert r.status_code == 200, r.text
        assert "engine for stand-in with tensor_parallel_size=2 pipeline_parallel_size=1" in proc.output()
        assert json.loads((repo / "llm" / "1" / "model.json").read_text())["tensor_parallel_size"] == 1
        answer = generate(proc, "llm", {"text_input": "a b", "parameters": {"max_tokens": 2}})
        assert answer.json()["text_output"] == "a b b a"
        r = load({"pipeline_parallel_size": {"string_value": "two"}})
        assert r.status_code == 400
        assert "config parameter 'pipeline_parallel_size' must be a positive integer" in r.json()["error"]
        r = load({"distributed_executor_backend": {"string_value": "slurm"}})
        assert r.status_code == 400
        assert "'distributed_executor_backend' must be one of ray, mp, uni" in r.json()["error"]


def _cuda() -> bool:
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs vllm and a CUDA device")
def test_real_vllm_on_a_tiny_llama(tmp_path):
    from test_transformers import build_model

    repo = tmp_path / "models"
    write_model(
        repo,
        "tiny",
        {
            "model": str(repo / "tiny" / "1"),
            "dtype": "float32",
            "max_model_len": 256,
            "gpu_memory_utilization": 0.3,
            "enforce_eager": True,
        },
    )
    build_model(repo / "tiny" / "1")
    env = {
        "PYTHONPATH": str(ROOT / "server"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
    }
    with NaiadProcess(repo, env=env, timeout=600) as proc:
        body = {
            "text_input": "the quick brown fox",
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0, "ignore_eos": True}),
        }
        whole = generate(proc, "tiny", body).json()["text_output"]
        r = requests.post(
            f"{proc.url}/v2/models/tiny/generate_stream", json={**body, "stream": True}, stream=True
        )
        deltas = [
            json.loads(line[6:])["text_output"] for line in r.iter_lines() if line.startswith(b"data: ")
        ]
        assert whole and "".join(deltas) == whole
