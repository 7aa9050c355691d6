"""Hostile input to a real LLM engine (`backend: "llamacpp"`, a tiny random-weight GGUF) on every endpoint that
reaches it: over-long prompts refused before any tokenizer sees them, large prompts tokenized off the event loop
within a deadline, SIGTERM during one, many stop strings, huge `n` and `logprobs`, deeply nested schemas, mass
disconnects and a stalled reader. Each asserts what a client sees (status, error, answer time), what every other
client sees meanwhile (health and a normal request's latency), and what the engine keeps (slots, KV cache, memory).
"""

from __future__ import annotations

import json
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from helpers import NaiadProcess
from llm_models import write_tiny_gguf

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)"
)

MODEL = (
    "llama"  # n_ctx 2048: prompts of more than 2048 x 12 bytes (the vocabulary's longest token) are refused
)
WIDE = (
    "llama_wide"  # n_ctx 65536, one slot: a prompt just under its bound (768 KiB) takes a while to tokenize
)
# a SentencePiece vocabulary of byte tokens alone, as the attacker found it: llama.cpp's tokenizer is
# quadratic on it (here, "word " x 10,000: 0.55 s; x 20,000: 2.0 s; x 100,000: minutes)
SPM = "llama_spm"
TOKENIZE_TIMEOUT_S = 30.0
HOSTILE = "word " * 100_000  # 500 KB
HUGE = "word " * 2_000_000  # 10 MB


def _config(n_ctx: int, n_parallel: int) -> str:
    return (
        'backend: "llamacpp"\n'
        f'parameters {{ key: "n_ctx" value: {{ string_value: "{n_ctx}" }} }}\n'
        f'parameters {{ key: "n_parallel" value: {{ string_value: "{n_parallel}" }} }}\n'
        'parameters { key: "n_threads" value: { string_value: "1" } }\n'
    )


def write_byte_spm_gguf(path: Path) -> None:
    """A random-weight llama whose SentencePiece vocabulary is the 256 byte tokens (and <unk>, <s>, </s>)."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    n_embd, n_ff = 64, 128
    rng = np.random.default_rng(0)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(len(tokens))
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [6] * 256)  # unknown, control x2, then bytes
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", mat(len(tokens), n_embd))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, np.float32))
    for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
        w.add_tensor(f"blk.0.{t}.weight", mat(n_embd, n_embd))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", mat(n_ff, n_embd))
    w.add_tensor("blk.0.ffn_up.weight", mat(n_ff, n_embd))
    w.add_tensor("blk.0.ffn_down.weight", mat(n_embd, n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", mat(len(tokens), n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile_repo")
    for name, n_ctx, n_parallel in ((MODEL, 2048, 4), (WIDE, 65536, 1)):
        write_tiny_gguf(root / name / "1" / "model.gguf")
        (root / name / "config.pbtxt").write_text(_config(n_ctx, n_parallel))
    write_byte_spm_gguf(root / SPM / "1" / "model.gguf")
    (root / SPM / "config.pbtxt").write_text(_config(2048, 2))
    return root


@pytest.fixture(scope="module")
def naiad(repo):
    with NaiadProcess(
        repo,
        "--openai-stall-timeout",
        "2",
        "--llm-tokenize-timeout-secs",
        str(TOKENIZE_TIMEOUT_S),
        timeout=120,
    ) as proc:
        yield proc


def _timed(fn: Callable[[], requests.Response]) -> tuple[requests.Response, float]:
    start = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - start


def _post(naiad, path: str, body: dict | bytes, timeout: float = 60) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(
        f"{naiad.url}{path}", data=data, headers={"Content-Type": "application/json"}, timeout=timeout
    )


def _health_ms(naiad) -> float:
    start = time.perf_counter()
    r = requests.get(f"{naiad.url}/v2/health/ready", timeout=30)
    assert r.status_code == 200
    return (time.perf_counter() - start) * 1000


def _normal_completion(naiad) -> float:
    """A small completion's answer time in seconds (the tiny model: about a millisecond a token)."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    r, took = _timed(lambda: _post(naiad, "/v1/completions", body))
    assert r.status_code == 200, r.text
    return took


def _best_of(n: int, fn: Callable[[], float]) -> float:
    """The median of `n` measurements: one preemption of this 2-core machine is not the server's latency."""
    return statistics.median(fn() for _ in range(n))


def _reference(naiad, prompt: str) -> float:
    """What a request of the same size costs this machine now when the server refuses it before any model work (no
    such model: the body read and parsed, a 404): the yardstick of the timing checks below. The issue's figures
    (100 ms, 1 s, 50 ms) hold on a quiet machine; a loaded one (a CI run's other tiers beside this one) is allowed
    the same multiple of its own reference, so what is checked is that the prompt costs no more than reading it."""
    body = {"model": "no_such_model", "prompt": prompt}
    return _best_of(3, lambda: _timed(lambda: _post(naiad, "/v1/completions", body))[1])


def _quick(took: float, limit: float, reference: float, factor: float = 2.0) -> bool:
    return took < limit or took < factor * reference


def _metric(naiad, name: str, model: str) -> float:
    text = requests.get(f"http://{naiad.metrics}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model_name="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _rss_kb(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])


def _openai_error(r: requests.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


# ---- over-long prompts: refused by their size, untokenized ----


def test_a_500kb_prompt_is_refused_in_under_100ms_and_a_normal_request_meanwhile_in_under_50ms(naiad):
    body = {"model": MODEL, "prompt": HOSTILE, "max_tokens": 4}
    _post(naiad, "/v1/completions", body)  # (connections and first-use costs out of the figures)

    def hostile() -> float:
        r, took = _timed(lambda: _post(naiad, "/v1/completions", body))
        error = _openai_error(r)
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert "maximum context length is 2048 tokens" in error["message"]
        return took

    took = _best_of(5, hostile)
    assert _quick(took, 0.1, _reference(naiad, HOSTILE)), took
    alone = _best_of(5, lambda: _normal_completion(naiad))

    def beside(attack: bytes, status: int) -> float:
        """A normal completion's time while three posts of `attack` (encoded once: this process's threads
        encoding 500 KB of JSON held the GIL the timed request needs) are in flight."""
        with ThreadPoolExecutor(3) as pool:
            attacks = [pool.submit(_post, naiad, "/v1/completions", attack) for _ in range(3)]
            took = _normal_completion(naiad)
            assert all(a.result().status_code == status for a in attacks)
        return took

    during = _best_of(5, lambda: beside(json.dumps(body).encode(), 400))
    # The yardstick on a loaded machine: the same three bodies refused before any model work (no such model).
    reading = _best_of(5, lambda: beside(json.dumps({**body, "model": "no_such_model"}).encode(), 404))
    assert _quick(during, 0.05, alone, factor=3.0) or during < 2 * reading, (during, alone, reading)


def test_a_superlinear_tokenizer_never_sees_the_500kb_prompt(naiad):
    """The issue's attack as it was: a byte-token SentencePiece vocabulary, on which llama.cpp's tokenizer takes
    minutes for this prompt. Its bound (2048 tokens x 5 bytes, `<unk>` being the longest text) refuses it at once;
    the longest prompt within the bound tokenizes in milliseconds, and every path stays responsive."""
    body = {"model": SPM, "prompt": HOSTILE, "max_tokens": 4}
    reference = _reference(naiad, HOSTILE)
    r, took = _timed(lambda: _post(naiad, "/v1/completions", body))
    assert _openai_error(r)["code"] == "context_length_exceeded" and _quick(took, 0.1, reference), took
    r, took = _timed(lambda: _post(naiad, "/tokenize", {"model": SPM, "prompt": HOSTILE}))
    assert r.status_code == 400 and _quick(took, 0.1, reference), (r.text, took)
    sampling = json.dumps({"max_tokens": 4})
    r, took = _timed(
        lambda: _post(
            naiad, f"/v2/models/{SPM}/generate", {"text_input": HOSTILE, "sampling_parameters": sampling}
        )
    )
    assert r.status_code == 400 and took < 0.5, (r.text, took)
    within = (
        "word " * 2000
    )  # 10,000 bytes, just under the bound: tokenized (then too many tokens for the context)
    r, took = _timed(
        lambda: _post(naiad, "/v1/completions", {"model": SPM, "prompt": within, "max_tokens": 1})
    )
    assert _openai_error(r)["code"] == "context_length_exceeded" and "tokens" in r.json()["error"]["message"]
    assert took < 1.0, took
    assert _normal_completion(naiad) < 1.0


def test_a_10mb_prompt_is_refused_in_under_1s_on_completions_and_chat(naiad):
    reference = _reference(naiad, HUGE)
    r, took = _timed(lambda: _post(naiad, "/v1/completions", {"model": MODEL, "prompt": HUGE}))
    assert _openai_error(r)["code"] == "context_length_exceeded" and _quick(took, 1.0, reference), took
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HUGE}]
    r, took = _timed(lambda: _post(naiad, "/v1/chat/completions", {"model": MODEL, "messages": messages}))
    error = _openai_error(r)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages", error
    assert _quick(took, 1.0, reference, factor=3.0), (took, reference)  # (the chat template renders it first)
    assert _health_ms(naiad) < 1000


def test_every_path_that_tokenizes_refuses_the_500kb_prompt_at_once(naiad):
    # Triton's generate extension (the vLLM shape: the backend's own check, before its tokenizer)
    body = {"text_input": HOSTILE, "sampling_parameters": json.dumps({"max_tokens": 4})}
    r, took = _timed(lambda: _post(naiad, f"/v2/models/{MODEL}/generate", body))
    assert r.status_code == 400 and "maximum context length is 2048 tokens" in r.json()["error"], r.text
    assert took < 0.5
    r = _post(naiad, f"/v2/models/{MODEL}/generate_stream", {**body, "stream": True})
    # as Triton answers a stream whose first response is an error: its status, the error as the one event
    assert r.status_code == 400 and r.text.startswith("data: ") and "bytes" in r.text, r.text
    # a streamed chat, and embeddings
    chat = {"model": MODEL, "messages": [{"role": "user", "content": HOSTILE}], "stream": True}
    assert _openai_error(_post(naiad, "/v1/chat/completions", chat))["code"] == "context_length_exceeded"
    r, took = _timed(lambda: _post(naiad, "/v1/embeddings", {"model": MODEL, "input": HOSTILE}))
    assert r.status_code == 400 and "bytes" in r.json()["error"]["message"] and took < 0.5, r.text
    # gRPC streaming in the vLLM shape
    errors: list = []
    with grpcclient.InferenceServerClient(naiad.grpc) as client:
        client.start_stream(callback=lambda result, error: errors.append(error))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([HOSTILE.encode()], dtype=object))
        start = time.perf_counter()
        client.async_stream_infer(MODEL, [text])
        while not errors and time.perf_counter() - start < 10:
            time.sleep(0.005)
        took = time.perf_counter() - start
        client.stop_stream()
    assert errors and errors[0] is not None and "bytes" in str(errors[0]) and took < 0.5, (errors, took)


def test_a_prompt_just_under_the_bound_is_tokenized_off_the_loop(naiad):
    """The worst a prompt can be and still be tokenized: health and other models stay responsive meanwhile."""
    bound = 65536 * 12  # n_ctx x the tiny vocabulary's longest token
    prompt = ("word " * (bound // 5))[: bound - 16]
    result: dict = {}

    def attack() -> None:
        r = _post(naiad, "/v1/completions", {"model": WIDE, "prompt": prompt, "max_tokens": 1}, timeout=120)
        result["response"] = r

    health_alone = _best_of(5, lambda: _health_ms(naiad))
    normal_alone = _best_of(5, lambda: _normal_completion(naiad) * 1000)
    thread = threading.Thread(target=attack)
    thread.start()
    probes = []
    normal = []
    while thread.is_alive():
        probes.append(_health_ms(naiad))
        normal.append(_normal_completion(naiad) * 1000)
    thread.join()
    assert len(probes) >= 3, "the prompt was tokenized too fast to look at the loop meanwhile"
    # (50 ms on a quiet machine; on a loaded one, three times what they take there without the prompt)
    assert _quick(statistics.median(probes), 50, health_alone, factor=3.0), (probes, health_alone)
    assert _quick(statistics.median(normal), 50, normal_alone, factor=3.0), (normal, normal_alone)
    r = result["response"]
    assert r.status_code in (200, 400), r.text  # fits in bytes; its token count decides
    if r.status_code == 400:
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_tokenization_past_its_deadline_is_answered_and_abandoned(repo):
    bound = 65536 * 12
    prompt = ("word " * (bound // 5))[: bound - 16]
    with NaiadProcess(repo, "--llm-tokenize-timeout-secs", "0.05", timeout=120) as proc:
        r, took = _timed(lambda: _post(proc, "/v1/completions", {"model": WIDE, "prompt": prompt}))
        error = _openai_error(r)
        assert "did not finish within 0.05s" in error["message"] and error["param"] == "prompt"
        assert took < 2.0
        assert _health_ms(proc) < 1000
        # the model serves on (the abandoned tokenization finishes on its thread)
        body = {"model": WIDE, "prompt": "Hello", "max_tokens": 2}
        assert _post(proc, "/v1/completions", body).status_code == 200


def test_sigterm_during_a_long_tokenization_exits_within_the_exit_timeout(repo):
    bound = 65536 * 12
    prompt = ("word " * (bound // 5))[: bound - 16]
    proc = NaiadProcess(repo, "--exit-timeout-secs", "3").start()
    try:
        thread = threading.Thread(
            target=lambda: _post(proc, "/v1/completions", {"model": WIDE, "prompt": prompt}, timeout=60),
            daemon=True,
        )
        thread.start()
        time.sleep(0.05)
        assert proc.proc is not None
        start = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(timeout=30)
        took = time.monotonic() - start
    finally:
        proc.stop()
    assert took < 3.0 + 0.5, f"exited {took:.1f}s after SIGTERM"
    assert code in (0, 1), code


# ---- what a request may ask for ----


def test_stop_lists_are_bounded_and_the_longest_allowed_cost_other_clients_nothing(naiad):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "stop": ["x"] * 65}
    assert _openai_error(_post(naiad, "/v1/completions", body))["param"] == "stop"
    sampling = json.dumps({"max_tokens": 4, "stop": ["x" * 4097]})
    r = _post(naiad, f"/v2/models/{MODEL}/generate", {"text_input": "Hello", "sampling_parameters": sampling})
    assert r.status_code == 400 and "4096 characters" in r.json()["error"], r.text
    stops = ["a" * 4094 + f"{i:02d}" for i in range(64)]
    hostile = {"model": MODEL, "prompt": "a a a", "max_tokens": 300, "stop": stops, "temperature": 0}
    alone = _best_of(5, lambda: _normal_completion(naiad))
    with ThreadPoolExecutor(2) as pool:
        attack = pool.submit(_post, naiad, "/v1/completions", hostile)
        normal = [_normal_completion(naiad) for _ in range(5)]
        r = attack.result()
    assert r.status_code == 200, r.text
    assert _quick(statistics.median(normal), 0.25, alone, factor=4.0), (normal, alone)


def test_huge_n_logprobs_and_max_tokens_are_refused_or_bounded(naiad):
    assert (
        _openai_error(_post(naiad, "/v1/completions", {"model": MODEL, "prompt": "a", "n": 17}))["param"]
        == "n"
    )
    bad = {"model": MODEL, "prompt": "a", "logprobs": 21}
    assert _openai_error(_post(naiad, "/v1/completions", bad))["param"] == "logprobs"
    bad = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a"}],
        "logprobs": True,
        "top_logprobs": 21,
    }
    assert _openai_error(_post(naiad, "/v1/chat/completions", bad))["param"] == "top_logprobs"
    bad = {"model": MODEL, "prompt": "a", "max_tokens": 10**12}
    assert _openai_error(_post(naiad, "/v1/completions", bad))["code"] == "context_length_exceeded"
    # the most of everything at once is answered, in a bounded time
    body = {"model": MODEL, "prompt": "a", "n": 16, "logprobs": 20, "max_tokens": 32, "temperature": 1.0}
    r, took = _timed(lambda: _post(naiad, "/v1/completions", body))
    assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text
    # (keyed by the tokens' text: byte tokens that decode alike share an entry)
    assert all(0 < len(c["logprobs"]["top_logprobs"][0]) <= 21 for c in r.json()["choices"])
    assert took < 30


@pytest.mark.parametrize("depth", [50, 400, 900, 5000])
def test_deeply_nested_schemas_get_a_clear_answer(naiad, depth):
    # written as text: deeper than any JSON library here will encode
    schema = (
        '{"type": "object", "required": ["a"], "properties": {"a": ' * depth
        + '{"type": "string"}'
        + "}}" * depth
    )
    head = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "json"}], "max_tokens": 4})
    fmt = (
        '"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": '
        + schema
        + "}}}"
    )
    body = (head[:-1] + ", " + fmt).encode()
    r, took = _timed(lambda: _post(naiad, "/v1/chat/completions", body))
    assert r.status_code in (200, 400), r.text  # never a 500: followed, or refused with a reason
    if r.status_code == 400:
        assert r.json()["error"]["message"]
    assert took < 30
    assert _health_ms(naiad) < 1000


# ---- clients that go away or stop reading ----


def _open_stream(naiad, model: str, max_tokens: int) -> socket.socket:
    body = json.dumps(
        {"model": model, "prompt": "Tell me", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", naiad.http_port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_after_mass_disconnects_the_slots_and_the_kv_cache_gauge_are_freed(naiad):
    socks = [_open_stream(naiad, MODEL, 1500) for _ in range(32)]
    deadline = time.monotonic() + 30
    while _metric(naiad, "vllm:num_requests_running", MODEL) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _metric(naiad, "vllm:kv_cache_usage_perc", MODEL) > 0
    for s in socks:
        s.close()
    freed = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = _metric(naiad, "vllm:num_requests_running", MODEL)
        waiting = _metric(naiad, "vllm:num_requests_waiting", MODEL)
        if freed is None and running == 0 and waiting == 0:
            freed = time.monotonic()
        if freed is not None and _metric(naiad, "vllm:kv_cache_usage_perc", MODEL) == 0:
            break
        time.sleep(0.02)
    assert freed is not None, "the disconnected streams kept their slots"
    assert time.monotonic() - freed < 1.0
    assert _metric(naiad, "vllm:kv_cache_usage_perc", MODEL) == 0
    assert _normal_completion(naiad) < 1.0  # every slot serves again


def test_a_stalled_reader_loses_its_slot_and_others_are_served(naiad):
    sock = _open_stream(naiad, WIDE, 60000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        deadline = time.monotonic() + 60
        while _metric(naiad, "vllm:num_requests_running", WIDE) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _normal_completion(naiad) < 0.5  # another model, served while WIDE streams into a full socket
        while _metric(naiad, "vllm:num_requests_running", WIDE) > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _metric(naiad, "vllm:num_requests_running", WIDE) == 0, "the stalled stream kept its slot"
    finally:
        sock.close()


def test_hostile_requests_leave_no_memory_behind(naiad):
    assert naiad.proc is not None
    for _ in range(3):  # the first ones size the allocator's arenas
        _post(naiad, "/v1/completions", {"model": MODEL, "prompt": HUGE})
    before = _rss_kb(naiad.proc.pid)
    for _ in range(20):
        _openai_error(_post(naiad, "/v1/completions", {"model": MODEL, "prompt": HUGE}))
        chat = {"model": MODEL, "messages": [{"role": "user", "content": HOSTILE}]}
        _openai_error(_post(naiad, "/v1/chat/completions", chat))
    grown = _rss_kb(naiad.proc.pid) - before
    assert grown < 100_000, f"the server grew by {grown} kB over 40 refused prompts"
