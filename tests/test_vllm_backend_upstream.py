"""Triton's own vllm_backend `model.py`, unmodified (tests/third_party/vllm_backend, commit 8de0c14), installed as a
python-based backend and served by Naiad on its `triton_python_backend_utils`, against the stand-in `vllm` package
(no GPU here): the auto-completed config, generate and generate_stream, the OpenAI API through the `openai` client,
cancellation, and the backend's own custom metrics."""

from __future__ import annotations

import shutil

import pytest
import requests
from helpers import ROOT
from test_vllm_python_backend import cancel_a_long_stream, serve_backend, write_model

UPSTREAM = ROOT / "tests" / "third_party" / "vllm_backend" / "src"
pytest.importorskip("PIL", reason="vllm_backend's utils/request.py imports Pillow")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_upstream")
    shutil.copytree(
        UPSTREAM, tmp / "backends" / "vllm"
    )  # <backend-directory>/vllm/model.py, as Triton installs it
    repo = tmp / "models"
    write_model(
        repo,
        "vllm_model",
        "instance_group [ { count: 1 kind: KIND_MODEL } ]\n"
        'parameters: { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }\n',
    )
    with serve_backend(tmp, repo) as proc:
        yield proc


def test_the_bare_config_is_completed_by_the_backend(server):
    config = requests.get(f"{server.url}/v2/models/vllm_model/config", timeout=10).json()
    names = [i["name"] for i in config["input"]]
    assert names[:5] == ["text_input", "image", "stream", "sampling_parameters", "exclude_input_in_output"]
    assert "embedding_request" in names and "return_num_output_tokens" in names
    assert config["model_transaction_policy"]["decoupled"] is True and config["max_batch_size"] == 0


def test_generate_and_generate_stream(server):
    r = requests.post(
        f"{server.url}/v2/models/vllm_model/generate",
        json={"text_input": "one two three", "parameters": {"max_tokens": 4}},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == "one two three three two one three"
    body = {
        "text_input": "one two three",
        "stream": True,
        "exclude_input_in_output": True,
        "sampling_parameters": '{"max_tokens": 4}',
    }
    r = requests.post(f"{server.url}/v2/models/vllm_model/generate_stream", json=body, timeout=30)
    assert r.status_code == 200, r.text
    texts = [line[len("data: ") :] for line in r.text.split("\n") if line.startswith("data: ")]
    assert len(texts) >= 4 and '"text_output"' in texts[0]


def test_openai_chat_and_completions(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        messages = [{"role": "user", "content": "one two three"}]
        whole = client.chat.completions.create(model="vllm_model", messages=messages, max_tokens=4)
        assert whole.choices[0].message.content.split() == ["three", "two", "one", "three"]
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.prompt_tokens == 3 and whole.usage.completion_tokens == 4
        chunks = list(
            client.chat.completions.create(
                model="vllm_model",
                messages=messages,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 4
        done = client.completions.create(model="vllm_model", prompt="one two three", max_tokens=4)
        assert done.choices[0].text.split() == ["three", "two", "one", "three"]
    finally:
        client.close()


def test_cancelling_a_stream_aborts_the_request(server):
    """A gRPC stream cancelled mid-generation: the backend sees is_cancelled() and aborts the engine's request; the
    model keeps serving."""
    cancel_a_long_stream(server)
    r = requests.post(
        f"{server.url}/v2/models/vllm_model/generate",
        json={"text_input": "a b", "parameters": {"max_tokens": 2}},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def test_the_backends_custom_metrics(server):
    text = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
    samples = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:") and 'model="vllm_model"' in line and "_bucket" not in line
    }
    assert samples["vllm:prompt_tokens_total"] > 0 and samples["vllm:generation_tokens_total"] > 0
    assert samples["vllm:time_to_first_token_seconds_count"] > 0
