"""`n` > 1 over the OpenAI API: n choices (index 0..n-1) for chat and completions, whole and streamed, the prompt
counted once and every choice's completion tokens summed; choice i samples with seed + i; on the counting models
(every count known) and on a tiny random-weight GGUF served by llama.cpp, driven by the `openai` client."""

from __future__ import annotations

import json
import re
import time

import pytest
import requests
from helpers import NaiadProcess
from llm_models import write_llamacpp_model
from openai_clients import model_metric, v1_client
from openai_models import build

pytestmark = pytest.mark.timeout(240)

GGUF = "tiny_llama"
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = build(tmp_path_factory.mktemp("openai_n") / "models")
    write_llamacpp_model(repo / GGUF)
    with NaiadProcess(repo, "--allow-grpc", "false", timeout=180) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    with v1_client(server) as c:
        yield c


def aborted(server) -> float:
    text = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
    pattern = re.compile(r"^vllm:request_success_total\{([^}]*)\} (\S+)$", re.M)
    return sum(
        float(v)
        for labels, v in pattern.findall(text)
        if f'model_name="{GGUF}"' in labels and "abort" in labels
    )


def test_chat_n_choices_and_usage(client):
    one = client.chat.completions.create(model="counting_vllm", messages=MESSAGES, max_tokens=5)
    out = client.chat.completions.create(model="counting_vllm", messages=MESSAGES, max_tokens=5, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in out.choices)
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert out.usage.completion_tokens == 3 * one.usage.completion_tokens == 15
    assert out.usage.total_tokens == out.usage.prompt_tokens + 15


def test_completions_n_streamed(client):
    stream = client.completions.create(
        model="counting_vllm",
        prompt="count",
        max_tokens=4,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts: dict[int, str] = {}
    reasons: dict[int, list] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            reasons.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {i: " tok0 tok1 tok2 tok3" for i in range(3)}
    assert reasons == {i: ["length"] for i in range(3)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_n_streamed_has_a_role_and_a_finish_per_choice(server):
    body = {"model": "counting_vllm", "messages": MESSAGES, "max_tokens": 2, "n": 2, "stream": True}
    r = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role")]
    finishes = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
    assert r.text.endswith("data: [DONE]\n\n")


def test_each_choice_gets_seed_plus_its_index(client):
    out = client.chat.completions.create(
        model="counting_vllm", messages=[{"role": "user", "content": "SHOWPARAMS"}], seed=40, n=3
    )
    seeds = [json.loads(c.message.content)["sampling_parameters"]["seed"] for c in out.choices]
    assert seeds == [40, 41, 42]
    unseeded = client.chat.completions.create(
        model="counting_vllm", messages=[{"role": "user", "content": "SHOWPARAMS"}], n=2
    )
    assert all("seed" not in json.loads(c.message.content)["sampling_parameters"] for c in unseeded.choices)


def test_n_is_bounded(server):
    for n, param in ((17, "n"), (0, "n"), ("2", "n")):
        body = {"model": "counting_vllm", "messages": MESSAGES, "n": n}
        r = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    body = {"model": "counting_vllm", "messages": MESSAGES, "n": 16, "max_tokens": 1}
    r = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 16


def test_llama_cpp_n_choices_are_the_seeded_single_choices(client):
    prompt = "Once upon a time"
    out = client.completions.create(model=GGUF, prompt=prompt, max_tokens=12, seed=100, n=4)
    texts = [c.text for c in out.choices]
    assert len(set(texts)) > 1  # different seeds, different samples
    singles = [
        client.completions.create(model=GGUF, prompt=prompt, max_tokens=12, seed=100 + i).choices[0].text
        for i in range(4)
    ]
    assert texts == singles
    assert out.usage.completion_tokens == sum(
        client.completions.create(
            model=GGUF, prompt=prompt, max_tokens=12, seed=100 + i
        ).usage.completion_tokens
        for i in range(4)
    )
    stream = client.completions.create(model=GGUF, prompt=prompt, max_tokens=12, seed=100, n=4, stream=True)
    streamed = ["", "", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


def test_llama_cpp_n_chat_with_structured_output(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=GGUF,
        messages=MESSAGES,
        max_tokens=32,
        seed=1,
        n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content)["ok"], bool)


def test_a_client_leaving_cancels_every_choice(server):
    before = model_metric(server, "vllm:generation_tokens_total", GGUF)
    aborted_before = aborted(server)
    body = {"model": GGUF, "prompt": "Once", "max_tokens": 1500, "n": 4, "stream": True, "ignore_eos": True}
    with requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith(b"data: ")
    deadline = time.monotonic() + 20
    while model_metric(server, "vllm:num_requests_running", GGUF) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert model_metric(server, "vllm:num_requests_running", GGUF) == 0
    assert model_metric(server, "vllm:generation_tokens_total", GGUF) - before < 4 * 1500
    assert aborted(server) - aborted_before == 4  # every choice's generation, not only the first


def test_a_client_leaving_a_whole_response_cancels_every_choice(server):
    aborted_before = aborted(server)
    body = {"model": GGUF, "prompt": "Once", "max_tokens": 2000, "n": 4, "ignore_eos": True}
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 20
    while aborted(server) - aborted_before < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted(server) - aborted_before == 4
    assert model_metric(server, "vllm:num_requests_running", GGUF) == 0
