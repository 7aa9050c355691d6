"""The OpenAI API and Triton's generate extension under `naiad serve --frontend-workers 2`: the /v1 routes on the
HTTP port and on --openai-port are served by the worker processes (not the engine), test_openai.py's suite passes
through them as it does in one process, streams cross from the engine token by token, a client that goes away
cancels the generation in the engine, and a llama.cpp GGUF's tokenizer (context checks) is asked of the engine."""

from __future__ import annotations

import json
import time

import openai
import psutil
import pytest
import requests
from helpers import NaiadProcess, free_ports
from llm_models import write_tiny_gguf
from openai_clients import v1_client
from openai_models import build
from test_frontend_workers import wait_for, worker_pids

# test_openai.py's tests, run here against the worker processes (their fixtures `server` and `client` are this
# module's); the ones that start servers of their own, and its model list of four, stay there
from test_openai import (  # noqa: F401
    assert_openai_error,
    test_a_reader_that_stalls_is_dropped,
    test_bad_input,
    test_chat_completion,
    test_chat_stream_with_usage,
    test_chat_template_from_tokenizer_config,
    test_chat_template_raise_exception_is_a_400,
    test_completion_and_echo,
    test_curl,
    test_disconnect_cancels_a_request_that_does_not_stream,
    test_disconnect_cancels_the_request,
    test_embeddings,
    test_embeddings_base64_on_the_wire,
    test_error_after_the_stream_started,
    test_logprobs,
    test_many_concurrent_streams_all_complete,
    test_openai_port_serves_only_v1,
    test_response_format,
    test_sampling_parameters_reach_a_vllm_shape_model,
    test_stream_without_usage_ends_with_done,
    test_tool_calls,
    test_trtllm_shape_decoupled_model_streams,
    test_trtllm_shape_model,
    test_trtllm_shape_refuses_what_it_cannot_take,
)

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)"
)

pytestmark = pytest.mark.timeout(240)

GGUF = "tiny_llama"  # one thread: OpenMP's thread team stalls on a loaded machine
SHORT = "tiny_llama_short"  # n_ctx 64, for the context check


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build(tmp_path_factory.mktemp("workers_openai") / "models")


@pytest.fixture(scope="module")
def gguf_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("workers_gguf") / "models"
    for name, extra in ((GGUF, ""), (SHORT, 'parameters { key: "n_ctx" value: { string_value: "64" } }\n')):
        write_tiny_gguf(repo / name / "1" / "model.gguf")
        (repo / name / "config.pbtxt").write_text(
            'backend: "llamacpp"\nparameters { key: "n_threads" value: { string_value: "1" } }\n' + extra
        )
    return repo


@pytest.fixture(scope="module")
def server(repo, gguf_repo):
    (port,) = free_ports(1)
    proc = NaiadProcess(
        [repo, gguf_repo],
        "--frontend-workers",
        "2",
        "--allow-grpc",
        "false",
        "--openai-port",
        str(port),
        "--openai-stall-timeout",
        "2",
        timeout=180,
    )
    proc.openai_port = port
    proc.start()
    wait_for(lambda: len(worker_pids(proc)) == 2, what="two frontend workers")
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    with v1_client(server) as c:
        yield c


def metric(server, name: str, **labels) -> float:
    """A sample of the engine's /metrics (summed over the series that carry `labels`)."""
    text = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def listeners(pid: int, port: int) -> bool:
    return any(
        c.status == psutil.CONN_LISTEN and c.laddr.port == port
        for c in psutil.Process(pid).net_connections("tcp")
    )


def test_the_workers_serve_v1_and_the_openai_port(server):
    pids = worker_pids(server)
    for port in (server.http_port, server.openai_port):
        # --frontend-accept balanced (the default): the engine's acceptor listens and hands the workers sockets
        assert not any(listeners(pid, port) for pid in pids), port
        assert listeners(server.proc.pid, port), f"the engine process does not listen on {port}"
    for base in (server.url, f"http://127.0.0.1:{server.openai_port}"):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        names = [m.id for m in c.models.list()]
        assert names == [
            "counting_trtllm",
            "counting_trtllm_stream",
            "counting_vllm",
            "counting_vllm_guided",
            "thinking_vllm",
            GGUF,
            SHORT,
        ]
        assert c.models.retrieve(GGUF).id == GGUF
        for missing in ("nope", "plain"):  # no such model; a model that is no LLM
            with pytest.raises(openai.NotFoundError) as info:
                c.models.retrieve(missing)
            assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("port", ["http", "openai"])
def test_llama_chat_whole_and_streamed_agree(server, port):
    base = server.url if port == "http" else f"http://127.0.0.1:{server.openai_port}"
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "the quick brown fox"}]
    whole = c.chat.completions.create(model=GGUF, messages=messages, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert whole.usage.prompt_tokens > 3 and 0 < whole.usage.completion_tokens <= 12
    chunks = list(
        c.chat.completions.create(
            model=GGUF,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert "".join(pieces) == choice.message.content
    assert len(pieces) > 1, "the answer came in one piece"  # token by token (a token may decode to no text)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_llama_context_is_checked_with_the_engines_tokenizer(server):
    """The worker has no tokenizer of its own: the prompt's count comes from the engine's llama.cpp."""
    r = requests.post(
        f"{server.url}/v1/completions",
        json={"model": SHORT, "prompt": "the quick brown fox " * 40, "max_tokens": 4},
        timeout=60,
    )
    assert_openai_error(r, 400, code="context_length_exceeded")
    r = requests.post(
        f"{server.url}/v1/completions",
        json={"model": SHORT, "prompt": "the quick brown fox", "max_tokens": 80},
    )
    assert "maximum context length is 64 tokens" in assert_openai_error(r, 400, param="max_tokens")["message"]


def _stamps(response: requests.Response) -> list[tuple[float, bytes]]:
    out = []
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            out.append((time.monotonic(), line))
    return out


@pytest.mark.parametrize("path", ["/v1/completions", "/v2/models/counting_vllm/generate_stream"])
def test_tokens_cross_from_the_engine_as_they_are_made(server, path):
    """A model that takes 50 ms a token: 8 events spread over about 350 ms, not all at the end."""
    if path.startswith("/v1"):
        body = {"model": "counting_vllm", "prompt": "SLOW", "max_tokens": 8, "stream": True}
    else:
        body = {"text_input": "SLOW", "stream": True, "sampling_parameters": json.dumps({"max_tokens": 8})}
    with requests.post(f"{server.url}{path}", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        stamps = _stamps(r)
    tokens = [t for t, line in stamps if b"tok" in line]
    assert len(tokens) == 8, stamps
    assert tokens[-1] - tokens[0] > 0.2, "the tokens arrived together"


def test_generate_stream_disconnect_cancels_in_the_engine(server, tmp_path):
    marker = tmp_path / "cancelled"
    body = {
        "text_input": f"SLOW CANCELFILE:{marker}",
        "stream": True,
        "sampling_parameters": json.dumps({"max_tokens": 400}),
    }
    with requests.post(
        f"{server.url}/v2/models/counting_vllm/generate_stream", json=body, stream=True, timeout=30
    ) as r:
        assert next(r.iter_lines()).startswith(b"data: ")
    wait_for(marker.exists, timeout=15, what="the model to be told that its client went away")


@pytest.mark.parametrize("port", ["http", "openai"])
def test_llama_stream_disconnect_aborts_the_generation(server, port):
    """llama.cpp in the engine stops the sequence (vLLM's abort count, no request left running)."""
    base = server.url if port == "http" else f"http://127.0.0.1:{server.openai_port}"
    aborted = metric(server, "vllm:request_success_total", model_name=GGUF, finished_reason="abort")
    body = {
        "model": GGUF,
        "prompt": "Tell me a story",
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))
        assert metric(server, "vllm:num_requests_running", model_name=GGUF) >= 1
    wait_for(
        lambda: metric(server, "vllm:num_requests_running", model_name=GGUF) == 0,
        timeout=15,
        what="the engine to stop the generation",
    )
    assert (
        metric(server, "vllm:request_success_total", model_name=GGUF, finished_reason="abort") == aborted + 1
    )


def test_errors_are_openai_error_objects_on_both_ports(server):
    for base in (server.url, f"http://127.0.0.1:{server.openai_port}"):
        r = requests.post(
            f"{base}/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            timeout=30,
        )
        assert_openai_error(r, 404, code="model_not_found")
        r = requests.post(f"{base}/v1/completions", data=b"{not json", timeout=30)
        assert_openai_error(r, 400)


def test_server_log_has_no_tracebacks(server):
    """Everything above (disconnects, stalls, bad input) was answered without an unhandled error."""
    out = server.output()
    assert "Traceback" not in out and "Error handling request" not in out, out[-4000:]
