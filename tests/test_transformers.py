"""The transformers backend on a real `naiad serve`: a tiny random-weight llama saved with `save_pretrained` and a
word-level tokenizer trained here (nothing downloaded), driven with tritonclient's generate calls over HTTP and a
gRPC stream: greedy output equals `model.generate` in-process, streamed deltas add up to it, concurrent requests
share forwards, cancellation frees the sequence, and the token metrics count what was sent."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from helpers import NaiadProcess
from llm_models import SENTENCES, write_tiny_hf_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("transformers") / "models"
    (repo / "tiny" / "1").mkdir(parents=True)
    (repo / "tiny" / "config.pbtxt").write_text(
        'backend: "transformers"\ninstance_group [ { count: 1 kind: KIND_CPU } ]\n'
        'parameters: { key: "max_num_seqs" value: { string_value: "8" } }\n'
    )
    write_tiny_hf_llama(repo / "tiny" / "1")
    return repo


@pytest.fixture(scope="module")
def server(repo):
    with NaiadProcess(repo, timeout=180) as proc:
        yield proc


def reference(repo: Path, prompt: str, max_tokens: int) -> str:
    """Greedy generation in-process with transformers, up to the first end-of-sequence token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = repo / "tiny" / "1"
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
    if 2 in out:
        out = out[: out.index(2)]
    return tok.decode(out, skip_special_tokens=True)


def generate(server, body: dict) -> requests.Response:
    return requests.post(f"{server.url}/v2/models/tiny/generate", json=body, timeout=60)


def test_bare_config_completes_to_the_vllm_shape(server):
    config = requests.get(f"{server.url}/v2/models/tiny/config").json()
    assert {"text_input", "stream", "sampling_parameters", "embedding_request"} <= {
        i["name"] for i in config["input"]
    }
    assert config["model_transaction_policy"]["decoupled"] is True


def test_greedy_output_equals_model_generate(server, repo):
    prompt = "the quick brown fox"
    expected = reference(repo, prompt, 12)
    body = {
        "text_input": prompt,
        "sampling_parameters": json.dumps({"max_tokens": 12, "temperature": 0}),
        "exclude_input_in_output": True,
        "return_num_input_tokens": True,
        "return_finish_reason": True,
    }
    r = generate(server, body)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == expected
    assert r.json()["num_input_tokens"] == 5  # <s> and four words
    with_prompt = generate(server, {**body, "exclude_input_in_output": False}).json()["text_output"]
    assert with_prompt == prompt + expected


def test_streamed_deltas_concatenate_to_the_output(server, repo):
    prompt = "every request streams"
    expected = reference(repo, prompt, 10)
    r = requests.post(
        f"{server.url}/v2/models/tiny/generate_stream",
        json={
            "text_input": prompt,
            "stream": True,
            "sampling_parameters": json.dumps({"max_tokens": 10, "temperature": 0}),
        },
        stream=True,
        timeout=60,
    )
    deltas = [json.loads(line[6:])["text_output"] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert len(deltas) > 1 and "".join(deltas) == expected


def test_stop_string_ends_the_text_before_it(server, repo):
    prompt = "a small model"
    full = reference(repo, prompt, 12)
    words = full.split()
    if len(words) < 3:
        pytest.fail(f"the reference output is too short to pick a stop word: {full!r}")
    stop = words[2]
    body = {
        "text_input": prompt,
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "sampling_parameters": json.dumps({"max_tokens": 12, "temperature": 0, "stop": [stop]}),
    }
    answer = generate(server, body).json()
    assert answer["text_output"] == full[: full.find(stop)]
    assert answer["finish_reason"] == "stop"


def test_bad_requests_are_400(server):
    for params in ({"seed": "three"}, {"max_tokens": 1000}, {"temperature": "hot"}):
        r = generate(server, {"text_input": "the dog", "sampling_parameters": json.dumps(params)})
        assert r.status_code == 400, (params, r.text)
    r = generate(server, {"text_input": "the dog", "sampling_parameters": "{not json"})
    assert r.status_code == 400


def test_a_seed_gives_the_same_text_alone_or_in_a_busy_batch(server):
    def sample(seed: int, prompt: str = "the lazy dog") -> str:
        params = {"max_tokens": 10, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        body = {
            "text_input": prompt,
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params),
        }
        r = generate(server, body)
        assert r.status_code == 200, r.text
        return r.json()["text_output"]

    alone = {seed: sample(seed) for seed in (1, 2, 3)}
    assert len(set(alone.values())) > 1  # different seeds sample differently
    assert sample(1) == alone[1]
    # the same seeds while unseeded requests share the batches (and use torch's global generator)
    results: dict[int, str] = {}

    def busy(i: int) -> None:
        params = {"max_tokens": 30, "temperature": 1.0, "ignore_eos": True}
        generate(server, {"text_input": f"noise {i}", "sampling_parameters": json.dumps(params)})

    def seeded(seed: int) -> None:
        results[seed] = sample(seed)

    threads = [threading.Thread(target=busy, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=seeded, args=(seed,)) for seed in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == alone


def test_sampling_parameters_are_accepted(server):
    body = {
        "text_input": "the lazy dog",
        "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "top_k": 5}),
    }
    r = generate(server, body)
    assert r.status_code == 200, r.text


def test_embedding_is_the_mean_of_the_last_hidden_state(server, repo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = repo / "tiny" / "1"
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok("the quick brown fox")["input_ids"]
    with torch.no_grad():
        expected = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(dim=0).tolist()
    # text_input is a required input of the vLLM shape; with embedding_request present it is not read
    body = {"text_input": "", "embedding_request": json.dumps({"input": "the quick brown fox"})}
    r = generate(server, body)
    assert r.status_code == 200, r.text
    assert np.allclose(json.loads(r.json()["text_output"]), expected, atol=1e-5)


def test_concurrent_requests_share_a_forward(server):
    def one(i: int) -> None:
        body = {
            "text_input": SENTENCES[i % 4],
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 40, "temperature": 0, "ignore_eos": True}),
        }
        assert generate(server, body).status_code == 200

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = [
        int(line.split("model 'tiny': ")[1].split()[0])
        for line in server.output().splitlines()
        if "sequences in one forward" in line
    ]
    assert counts and max(counts) >= 2


def running(server) -> float:
    text = requests.get(f"http://{server.metrics}/metrics").text
    for line in text.splitlines():
        if line.startswith('vllm:num_requests_running{model_name="tiny"}'):
            return float(line.split()[-1])
    raise AssertionError("vllm:num_requests_running is missing from /metrics")


def aborted(server) -> float:
    text = requests.get(f"http://{server.metrics}/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
        and 'finished_reason="abort"' in line
        and '"tiny"' in line
    )


def test_cancelling_a_grpc_stream_frees_the_sequence(server):
    aborted_before = aborted(server)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tensors = []
    for name, dtype, value in (
        ("text_input", "BYTES", np.array([b"the quick brown fox"], dtype=object)),
        ("stream", "BOOL", np.array([True])),
        (
            "sampling_parameters",
            "BYTES",
            np.array([json.dumps({"max_tokens": 240, "ignore_eos": True}).encode()], dtype=object),
        ),
    ):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(value)
        tensors.append(t)
    client.async_stream_infer("tiny", tensors, request_id="long")
    for _ in range(3):
        _, error = results.get(timeout=60)
        assert error is None
    assert running(server) == 1
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 10
    while running(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(server) == 0
    assert aborted(server) - aborted_before == 1


def kv_cache_usage(server) -> float:
    text = requests.get(f"http://{server.metrics}/metrics").text
    for line in text.splitlines():
        if line.startswith('vllm:kv_cache_usage_perc{model_name="tiny"}'):
            return float(line.split()[-1])
    raise AssertionError('vllm:kv_cache_usage_perc{model_name="tiny"} is missing from /metrics')


def test_kv_cache_usage_follows_the_running_sequences(server):
    # the default cache: 256 blocks of 32 tokens; each request holds ceil((prompt + 200) / 32) = 7 blocks, so four
    # hold 28 of 256 at most (0.109); once they finish their blocks are free or kept only for prefix sharing, which
    # counts as free (as vLLM counts its cached blocks), so the gauge is back at 0
    deadline = time.monotonic() + 10
    while kv_cache_usage(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_cache_usage(server) == 0

    def one(i: int) -> None:
        body = {
            "text_input": SENTENCES[i % 4],
            "sampling_parameters": json.dumps({"max_tokens": 200, "temperature": 0, "ignore_eos": True}),
        }
        assert generate(server, body).status_code == 200

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    seen = []
    while any(t.is_alive() for t in threads):
        seen.append(kv_cache_usage(server))
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert max(seen) > 0
    assert max(seen) <= 4 * 7 / 256
    deadline = time.monotonic() + 10
    while kv_cache_usage(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_cache_usage(server) == 0


# ---- KIND_GPU ----
@pytest.mark.gpu
def test_kind_gpu_greedy_output_equals_model_generate(tmp_path):
    """The same tiny model on KIND_GPU (float32 on cuda:0): greedy text equals `model.generate` on the CPU, 8
    concurrent requests complete, and the token metrics are exported for the GPU copy."""
    import gpu_models

    reason = gpu_models.torch_gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    repo = tmp_path / "models"
    (repo / "tiny" / "1").mkdir(parents=True)
    (repo / "tiny" / "config.pbtxt").write_text(
        'backend: "transformers"\ninstance_group [ { count: 1 kind: KIND_GPU } ]\n'
        'parameters: { key: "dtype" value: { string_value: "float32" } }\n'
    )
    write_tiny_hf_llama(repo / "tiny" / "1")
    prompt = "the quick brown fox"
    expected = reference(repo, prompt, 12)
    with NaiadProcess(repo, timeout=180) as gpu_server:
        body = {
            "text_input": prompt,
            "sampling_parameters": json.dumps({"max_tokens": 12, "temperature": 0}),
            "exclude_input_in_output": True,
        }
        r = generate(gpu_server, body)
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == expected
        many = {
            **body,
            "sampling_parameters": json.dumps({"max_tokens": 24, "temperature": 0, "ignore_eos": True}),
        }
        results: list[requests.Response] = []
        threads = [
            threading.Thread(target=lambda: results.append(generate(gpu_server, many))) for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [x.status_code for x in results] == [200] * 8
        metrics = requests.get(f"http://{gpu_server.metrics}/metrics", timeout=10).text
        assert 'vllm:kv_cache_usage_perc{model_name="tiny"' in metrics
        assert 'vllm:request_generation_tokens_count{model_name="tiny"' in metrics
