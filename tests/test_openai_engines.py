"""The OpenAI API over the real engines: a tiny random-weight GGUF served by llama.cpp (a one-line config) and a tiny
`LlamaConfig` model served by transformers, driven by the `openai` client and curl: chat with the model's own chat
template, completions, streaming with usage, embeddings, models; the answers agree with Triton's generate
extension on the same model, and the vLLM token metrics count what was sent."""

from __future__ import annotations

import json
import subprocess

import pytest
import requests
from helpers import NaiadProcess
from llm_models import write_tiny_gguf, write_tiny_hf_llama
from openai_clients import model_metric, v1_client

pytestmark = pytest.mark.timeout(240)

GGUF = "tiny_llama"
HF = "tiny_hf"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("openai_engines") / "models"
    write_tiny_gguf(repo / GGUF / "1" / "model.gguf")
    (repo / GGUF / "config.pbtxt").write_text(
        'backend: "llamacpp"\n'
        'parameters { key: "n_threads" value: { string_value: "1" } }\n'
        'parameters { key: "embeddings" value: { string_value: "true" } }\n'
    )
    (repo / HF / "1").mkdir(parents=True)
    (repo / HF / "config.pbtxt").write_text(
        'backend: "transformers"\ninstance_group [ { count: 1 kind: KIND_CPU } ]\n'
        'parameters: { key: "max_num_seqs" value: { string_value: "4" } }\n'
    )
    write_tiny_hf_llama(repo / HF / "1")
    with NaiadProcess(repo, "--allow-grpc", "false", timeout=180) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    with v1_client(server) as c:
        yield c


def test_models_lists_both_engines(client):
    ids = {m.id for m in client.models.list().data}
    assert {GGUF, HF} <= ids
    assert client.models.retrieve(GGUF).id == GGUF


@pytest.mark.parametrize("model", [GGUF, HF])
def test_chat_uses_the_models_template_and_streams_the_same_text(client, model):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 3 and 0 < whole.usage.completion_tokens <= 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_matches_the_generate_extension(server, client):
    prompt = "Once upon a time"
    done = client.completions.create(model=GGUF, prompt=prompt, max_tokens=12, temperature=0, seed=7)
    body = {
        "text_input": prompt,
        "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"max_tokens": 12, "temperature": 0, "seed": 7}),
    }
    r = requests.post(f"{server.url}/v2/models/{GGUF}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert done.choices[0].text == r.json()["text_output"]


def test_stop_and_max_tokens_reach_the_engine(client):
    long = client.completions.create(model=GGUF, prompt="Count to ten:", max_tokens=16, temperature=0)
    text = long.choices[0].text
    assert long.usage.completion_tokens <= 16
    if len(text) > 4:  # stop at a piece of the greedy text: the answer ends before it
        stop = text[2:4]
        cut = client.completions.create(
            model=GGUF, prompt="Count to ten:", max_tokens=16, temperature=0, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == text[: text.index(stop)]


def test_embeddings_from_llama_cpp(client):
    out = client.embeddings.create(model=GGUF, input=["hello world", "the sea and the sky"])
    assert [d.index for d in out.data] == [0, 1]
    assert len(out.data[0].embedding) == len(out.data[1].embedding) > 8
    assert out.data[0].embedding != out.data[1].embedding
    assert out.usage.prompt_tokens > 0


def test_curl_chat_and_openai_errors(server):
    body = json.dumps({"model": GGUF, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    out = subprocess.run(
        [
            "curl",
            "-s",
            f"{server.url}/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert json.loads(out)["object"] == "chat.completion"
    r = requests.post(
        f"{server.url}/v1/chat/completions",
        json={"model": GGUF, "messages": [{"role": "user", "content": "word " * 5000}]},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = requests.post(
        f"{server.url}/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2}, timeout=10
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_token_metrics_count_what_was_sent(server, client):
    before_prompt = model_metric(server, "vllm:prompt_tokens_total", GGUF)
    before_gen = model_metric(server, "vllm:generation_tokens_total", GGUF)
    before_ttft = model_metric(server, "vllm:time_to_first_token_seconds_count", GGUF)
    usage = [
        client.completions.create(model=GGUF, prompt=p, max_tokens=6, temperature=0).usage
        for p in ("one two", "the sky is", "hello")
    ]
    assert model_metric(server, "vllm:prompt_tokens_total", GGUF) - before_prompt == sum(
        u.prompt_tokens for u in usage
    )
    assert model_metric(server, "vllm:generation_tokens_total", GGUF) - before_gen == sum(
        u.completion_tokens for u in usage
    )
    assert model_metric(server, "vllm:time_to_first_token_seconds_count", GGUF) - before_ttft == 3
    assert model_metric(server, "vllm:num_requests_running", GGUF) == 0
    assert model_metric(server, "vllm:num_requests_waiting", GGUF) == 0


def test_transformers_seed_and_n_through_the_openai_client(client):
    kwargs = dict(
        model=HF, prompt="the quick brown fox", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True}
    )
    out = client.completions.create(seed=21, n=3, **kwargs)
    texts = [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [client.completions.create(seed=21 + i, **kwargs).choices[0].text for i in range(3)]
    assert out.usage.completion_tokens == 24
