"""The OpenAI-compatible API against a real `naiad serve`, driven by the `openai` Python client and `curl`: chat,
completions, streaming with usage, embeddings, models, tool calls, the vLLM and TensorRT-LLM shapes, OpenAI's error
objects for bad input, cancellation on disconnect, a stalled reader, restricted API and TLS."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
from helpers import NaiadProcess, free_ports
from openai_models import build

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("openai") / "models")


@pytest.fixture(scope="module")
def server(repo):
    (port,) = free_ports(1)
    proc = NaiadProcess(
        repo, "--allow-grpc", "false", "--openai-port", str(port), "--openai-stall-timeout", "2"
    )
    proc.openai_port = port
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    yield c
    c.close()


def post(server, path: str, body, **kw) -> requests.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return requests.post(f"{server.url}{path}", data=data, headers={"Content-Type": "application/json"}, **kw)


def events(response: requests.Response) -> list:
    """The `data:` events of an SSE body, JSON-decoded, with "[DONE]" as it is."""
    out = []
    for block in response.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_openai_error(r: requests.Response, status: int, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error") or status == 403
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- models ----


def test_models_list_and_get(client):
    names = [m.id for m in client.models.list()]
    assert names == [
        "counting_trtllm",
        "counting_trtllm_stream",
        "counting_vllm",
        "counting_vllm_guided",
        "thinking_vllm",
    ]
    card = client.models.retrieve("counting_vllm")
    assert card.id == "counting_vllm" and card.object == "model" and card.owned_by == "naiad"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("nope")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("plain")  # no LLM


# ---- chat ----


def test_chat_completion(client):
    r = client.chat.completions.create(
        model="counting_vllm", messages=[{"role": "user", "content": "hi there"}], max_tokens=3
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "counting_vllm"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == " tok0 tok1 tok2"
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 3, 6)
    r = client.chat.completions.create(
        model="counting_vllm", messages=[{"role": "user", "content": "STOPAT:2"}], max_completion_tokens=5
    )
    assert r.choices[0].message.content == " tok0 tok1" and r.choices[0].finish_reason == "stop"


def test_chat_template_from_tokenizer_config(client):
    r = client.chat.completions.create(
        model="counting_vllm",
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "SHOWPROMPT"}, {"type": "text", "text": "hi"}],
            },
        ],
    )
    assert r.choices[0].message.content == "<s><|system|>be brief\n<|user|>SHOWPROMPT\nhi\n<|assistant|>"


def test_chat_template_raise_exception_is_a_400(server):
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    r = post(server, "/v1/chat/completions", {"model": "counting_vllm", "messages": messages})
    assert "system must come first" in assert_openai_error(r, 400)["message"]


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model="counting_vllm",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " tok0 tok1 tok2 tok3"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == 2 and chunks[-1].usage.total_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_ends_with_done(server):
    body = {
        "model": "counting_vllm",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "stream": True,
    }
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    got = events(r)
    assert got[-1] == "[DONE]" and all("usage" not in e for e in got[:-1])
    assert got[-2]["choices"][0]["finish_reason"] == "length" and got[-2]["choices"][0]["delta"] == {}


def test_tokens_ready_together_go_out_in_one_write(server):
    """Tokens that arrive faster than the event loop writes go out together (one HTTP chunk), each a whole event
    of its own, in order."""
    body = {"model": "counting_vllm", "prompt": "x", "max_tokens": 400, "stream": True}
    with post(server, "/v1/completions", body, stream=True) as r:
        assert r.status_code == 200
        chunks = list(r.raw.read_chunked(decode_content=False))
    assert all(c.endswith(b"\n\n") for c in chunks)
    got = [b[len(b"data: ") :] for b in b"".join(chunks).split(b"\n\n")[:-1]]
    assert got[-1] == b"[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in got[:-1]]
    assert "".join(texts) == "".join(f" tok{i}" for i in range(400))
    assert max(c.count(b"data: ") for c in chunks) > 1, f"{len(chunks)} chunks for {len(got)} events"


def test_sampling_parameters_reach_a_vllm_shape_model(client):
    r = client.chat.completions.create(
        model="counting_vllm",
        messages=[{"role": "user", "content": "SHOWPARAMS"}],
        max_completion_tokens=7,
        temperature=0.25,
        top_p=0.5,
        seed=11,
        stop=["END"],
        presence_penalty=0.5,
        extra_body={"top_k": 3, "repetition_penalty": 1.1, "unknown_field": {"is": "ignored"}},
    )
    got = json.loads(r.choices[0].message.content)
    assert got["sampling_parameters"] == {
        "max_tokens": 7,
        "temperature": 0.25,
        "top_p": 0.5,
        "seed": 11,
        "stop": ["END"],
        "presence_penalty": 0.5,
        "top_k": 3,
        "repetition_penalty": 1.1,
    }
    assert got["exclude_input_in_output"] is True and got["stream"] is False


def test_logprobs(client):
    r = client.chat.completions.create(
        model="counting_vllm",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == [" tok0", " tok1"] and content[0].logprob == -0.5
    assert [t.token for t in content[0].top_logprobs] == [" tok0", " alt"]
    c = client.completions.create(model="counting_vllm", prompt="x", max_tokens=2, logprobs=1)
    assert c.choices[0].logprobs.tokens == [" tok0", " tok1"]
    assert c.choices[0].logprobs.token_logprobs == [-0.5, -0.5] and c.choices[0].logprobs.text_offset == [
        0,
        5,
    ]
    stream = client.chat.completions.create(
        model="counting_vllm",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        logprobs=True,
        stream=True,
    )
    tokens = [
        t.token for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert tokens == [" tok0", " tok1"]


def test_tool_calls(client):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "TOOLCALL:weather"}]
    r = client.chat.completions.create(model="counting_vllm", messages=messages, tools=tools)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(
        client.chat.completions.create(model="counting_vllm", messages=messages, tools=tools, stream=True)
    )
    calls = [
        tc
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
        for tc in c.choices[0].delta.tool_calls
    ]
    assert [tc.function.name for tc in calls] == ["weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # text that is no tool call comes back as content, and the template saw the tools
    r = client.chat.completions.create(
        model="counting_vllm", messages=[{"role": "user", "content": "SHOWPROMPT"}], tools=tools
    )
    assert "<|tools|>weather" in r.choices[0].message.content and r.choices[0].message.tool_calls is None
    # forcing a tool needs guided decoding: refused where the model has none, passed on where it has
    with pytest.raises(openai.BadRequestError, match="guided decoding"):
        client.chat.completions.create(
            model="counting_vllm", messages=messages, tools=tools, tool_choice="required"
        )
    r = client.chat.completions.create(
        model="counting_vllm_guided",
        messages=[{"role": "user", "content": "SHOWPARAMS"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )
    guide = json.loads(json.loads(r.choices[0].message.content)["sampling_parameters"]["structured_outputs"])
    assert guide["json"]["properties"]["name"]["enum"] == ["weather"]


def test_response_format(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = client.chat.completions.create(
        model="counting_vllm_guided",
        messages=[{"role": "user", "content": "SHOWPARAMS"}],
        response_format=fmt,
    )
    params = json.loads(r.choices[0].message.content)["sampling_parameters"]
    assert json.loads(params["structured_outputs"]) == {"json": schema}
    with pytest.raises(openai.BadRequestError, match="guided decoding") as info:
        client.chat.completions.create(
            model="counting_vllm", messages=[{"role": "user", "content": "x"}], response_format=fmt
        )
    assert info.value.body["param"] == "response_format"


# ---- completions ----


def test_completion_and_echo(client):
    c = client.completions.create(model="counting_vllm", prompt="one two", max_tokens=2)
    assert c.object == "text_completion" and c.choices[0].text == " tok0 tok1" and c.usage.prompt_tokens == 2
    c = client.completions.create(model="counting_vllm", prompt="one two", max_tokens=2, echo=True)
    assert c.choices[0].text == "one two tok0 tok1"
    chunks = list(client.completions.create(model="counting_vllm", prompt="p", max_tokens=3, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == " tok0 tok1 tok2"
    assert chunks[-1].choices[0].finish_reason == "length"


# ---- the TensorRT-LLM shape ----


def test_trtllm_shape_model(client):
    r = client.completions.create(
        model="counting_trtllm", prompt="SHOWPARAMS", max_tokens=3, temperature=0.5, seed=4, stop=["x", "y"]
    )
    got = json.loads(r.choices[0].text)
    assert got["max_tokens"] == 3 and got["temperature"] == 0.5 and got["seed"] == 4
    assert got["stop_words"] == ["x", "y"] and got["stop_words_shape"] == [1, 2]
    assert (
        got["max_tokens_shape"] == [1, 1]
        and got["exclude_input_in_output"] is True
        and got["stream"] is False
    )
    r = client.chat.completions.create(
        model="counting_trtllm", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.choices[0].message.content == " tok0 tok1 tok2" and r.choices[0].finish_reason == "stop"
    # a model that does not stream answers a streaming request in one chunk
    chunks = list(
        client.chat.completions.create(
            model="counting_trtllm", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " tok0 tok1"


def test_trtllm_shape_decoupled_model_streams(client):
    chunks = list(
        client.completions.create(model="counting_trtllm_stream", prompt="a", max_tokens=3, stream=True)
    )
    texts = [c.choices[0].text for c in chunks]
    assert texts == [" tok0", " tok1", " tok2", ""] and chunks[-1].choices[0].finish_reason == "stop"
    c = client.completions.create(model="counting_trtllm_stream", prompt="a", max_tokens=3)
    assert c.choices[0].text == " tok0 tok1 tok2"


def test_trtllm_shape_refuses_what_it_cannot_take(server):
    r = post(server, "/v1/completions", {"model": "counting_trtllm", "prompt": "a", "presence_penalty": 1})
    assert "no 'presence_penalty' input" in assert_openai_error(r, 400, param="presence_penalty")["message"]
    r = post(server, "/v1/completions", {"model": "counting_trtllm", "prompt": "a", "logprobs": 1})
    assert_openai_error(r, 400, param="logprobs")


# ---- embeddings ----


def test_embeddings(client):
    e = client.embeddings.create(
        model="counting_vllm", input=["a b c", "d"], dimensions=3
    )  # base64 by default
    assert [d.embedding for d in e.data] == [pytest.approx([5.0, 0.1, 0.2]), pytest.approx([1.0, 0.1, 0.2])]
    assert e.usage.prompt_tokens == 4 and e.model == "counting_vllm"
    e = client.embeddings.create(model="counting_vllm", input="x y", encoding_format="float")
    assert e.data[0].embedding == pytest.approx([3.0, 0.1, 0.2, 0.3])


def test_embeddings_base64_on_the_wire(server):
    r = post(server, "/v1/embeddings", {"model": "counting_vllm", "input": "ab", "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert np.frombuffer(raw, "<f4").tolist() == pytest.approx([2.0, 0.1, 0.2, 0.3])


# ---- bad input: OpenAI's error object, never a 422 ----


def test_bad_input(server):
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    assert_openai_error(
        post(server, chat, {"model": "nope", "messages": msgs}), 404, "model", "model_not_found"
    )
    err = assert_openai_error(post(server, chat, {"model": "plain", "messages": msgs}), 400, "model")
    assert "not a language model" in err["message"]
    assert_openai_error(post(server, chat, '{"model": "counting_vllm", "messages": ['), 400)
    assert_openai_error(post(server, chat, "[1, 2]"), 400)
    assert_openai_error(post(server, chat, {"model": "counting_vllm", "messages": msgs, "n": 17}), 400, "n")
    assert_openai_error(post(server, chat, {"model": "counting_vllm"}), 400, "messages")
    assert_openai_error(post(server, chat, {"messages": msgs}), 400, "model")
    bad = {"model": "counting_vllm", "messages": msgs, "temperature": 9}
    assert_openai_error(post(server, chat, bad), 400, "temperature")
    bad = {"model": "counting_vllm", "messages": msgs, "max_tokens": 0}
    assert_openai_error(post(server, chat, bad), 400, "max_tokens")
    bad = {"model": "counting_vllm", "messages": [{"role": "robot", "content": "x"}]}
    assert_openai_error(post(server, chat, bad), 400, "messages[0].role")
    bad = {"model": "counting_vllm", "messages": msgs, "stream_options": {"include_usage": True}}
    assert_openai_error(post(server, chat, bad), 400, "stream_options")
    err = assert_openai_error(post(server, chat, {"model": "counting_trtllm_stream", "messages": msgs}), 400)
    assert "no chat template" in err["message"]
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    bad = {"model": "counting_vllm", "messages": [{"role": "user", "content": image}]}
    assert "is not multimodal" in assert_openai_error(post(server, chat, bad), 400)["message"]
    audio = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
    bad = {"model": "counting_vllm", "messages": [{"role": "user", "content": audio}]}
    assert "'input_audio'" in assert_openai_error(post(server, chat, bad), 400)["message"]
    assert_openai_error(
        post(server, "/v1/completions", {"model": "counting_vllm", "prompt": ["a", "b"]}), 400
    )
    err = assert_openai_error(post(server, "/v1/embeddings", {"model": "counting_trtllm", "input": "a"}), 400)
    assert "embeddings" in err["message"]
    # a route or method the API does not have: OpenAI's error object too
    assert_openai_error(requests.get(f"{server.url}/v1/chat/completions"), 405)
    assert_openai_error(post(server, "/v1/assistants", {"model": "counting_vllm"}), 404)
    # unknown fields are accepted
    ok = post(server, chat, {"model": "counting_vllm", "messages": msgs, "max_tokens": 1, "frobnicate": [1]})
    assert ok.status_code == 200, ok.text


def test_error_after_the_stream_started(server):
    body = {"model": "counting_vllm", "prompt": "FAIL:2", "max_tokens": 5, "stream": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200
    got = events(r)
    assert [e["choices"][0]["text"] for e in got[:2]] == [" tok0", " tok1"]
    assert "generation failed on purpose" in got[2]["error"]["message"] and got[3] == "[DONE]"


def test_disconnect_cancels_the_request(server, tmp_path):
    marker = tmp_path / "cancelled"
    body = {
        "model": "counting_vllm",
        "prompt": f"SLOW CANCELFILE:{marker}",
        "max_tokens": 400,
        "stream": True,
    }
    with requests.post(f"{server.url}/v1/completions", json=body, stream=True) as r:
        lines = r.iter_lines()
        assert next(lines).startswith(b"data: ")
    deadline = time.monotonic() + 15
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the model was not told that its client went away"


def test_disconnect_cancels_a_request_that_does_not_stream(server, tmp_path):
    marker = tmp_path / "cancelled"
    body = {"model": "counting_vllm", "prompt": f"SLOW CANCELFILE:{marker}", "max_tokens": 400}
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{server.url}/v1/completions", json=body, timeout=1)
    deadline = time.monotonic() + 15
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the model was not told that its client went away"


def _rss_kb(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])


def test_a_reader_that_stalls_is_dropped(server, tmp_path):
    """A client that stops reading a stream of 4 kB tokens made at up to 1,000 a second: the server's buffers stay
    bounded, and after the stall timeout (2 s here) the stream is dropped and the model request cancelled."""
    marker = tmp_path / "cancelled"
    body = json.dumps(
        {
            "model": "counting_vllm",
            "prompt": f"WIDE PACE CANCELFILE:{marker}",
            "max_tokens": 1_000_000,
            "stream": True,
        }
    ).encode()
    before = _rss_kb(server.proc.pid)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.http_port))
    started = time.monotonic()
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        peak = before
        while not marker.exists() and time.monotonic() - started < 30:
            peak = max(peak, _rss_kb(server.proc.pid))
            time.sleep(0.1)
        assert marker.exists(), "a stalled stream kept its model request running"
        took = time.monotonic() - started
    finally:
        sock.close()
    assert took < 15, f"the stall was noticed after {took:.1f} s"
    assert peak - before < 200_000, f"the server grew by {peak - before} kB for one stalled stream"
    assert requests.get(f"{server.url}/v1/models", timeout=5).status_code == 200


def test_many_concurrent_streams_all_complete(server):
    import asyncio

    async def one(c, i: int) -> str:
        stream = await c.completions.create(
            model="counting_vllm",
            prompt=f"PACE {i}",
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            text += "".join(ch.text for ch in chunk.choices)
            usage = chunk.usage or usage
        assert usage.completion_tokens == 20
        return text

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(48)))

    texts = asyncio.run(run())
    assert all(t == "".join(f" tok{i}" for i in range(20)) for t in texts)


# ---- curl and the OpenAI port ----


def test_curl(server):
    body = json.dumps(
        {"model": "counting_vllm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    )
    for port in (server.http_port, server.openai_port):
        out = subprocess.run(
            [
                "curl",
                "-sS",
                f"http://127.0.0.1:{port}/v1/chat/completions",
                "-H",
                "Content-Type: application/json",
                "-d",
                body,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert json.loads(out)["choices"][0]["message"]["content"] == " tok0 tok1"
    stream = json.dumps({"model": "counting_vllm", "prompt": "x", "max_tokens": 2, "stream": True})
    out = subprocess.run(
        [
            "curl",
            "-sSN",
            f"http://127.0.0.1:{server.openai_port}/v1/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            stream,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert out.endswith("data: [DONE]\n\n") and out.count("data: ") == 4


def test_openai_port_serves_only_v1(server):
    r = requests.get(f"http://127.0.0.1:{server.openai_port}/v2/health/ready")
    assert_openai_error(r, 404)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.openai_port}/v1", api_key="x", max_retries=0)
    assert (
        c.chat.completions.create(
            model="counting_vllm", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
        .choices[0]
        .message.content
        == " tok0"
    )


def test_chat_template_flag_serves_models_without_one(repo, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    with NaiadProcess(repo, "--allow-grpc", "false", "--chat-template", str(template)) as proc:
        c = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(
            model="counting_trtllm_stream", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        assert r.choices[0].message.content == " tok0 tok1"
        # a model's own template still comes first
        r = c.chat.completions.create(
            model="counting_vllm", messages=[{"role": "user", "content": "SHOWPROMPT"}]
        )
        assert r.choices[0].message.content.startswith("<s><|user|>")
    with pytest.raises(RuntimeError, match="--chat-template"):
        NaiadProcess(repo, "--chat-template", str(tmp_path / "missing.jinja")).start()


def test_server_log_has_no_tracebacks(server):
    """Everything above (disconnects, stalls, bad input) was answered without an unhandled error."""
    assert "Traceback" not in server.output() and "Error handling request" not in server.output()


# ---- restricted API and TLS ----


def test_restricted_openai_group(repo):
    (port,) = free_ports(1)
    with NaiadProcess(
        repo,
        "--allow-grpc",
        "false",
        "--openai-port",
        str(port),
        "--http-restricted-api",
        "openai:api-key=s3cret",
    ) as proc:
        for base in (proc.url, f"http://127.0.0.1:{port}"):
            r = requests.get(f"{base}/v1/models")
            err = assert_openai_error(r, 403)
            assert err["type"] == "permission_error" and "api-key" in err["message"]
            c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", default_headers={"api-key": "s3cret"})
            assert len(c.models.list().data) == 5
        assert requests.get(f"{proc.url}/v2/health/ready").status_code == 200  # other groups stay open


def test_tls_applies_to_v1_and_the_openai_port(repo, tmp_path):
    from pki import Pki

    pki = Pki(tmp_path / "pki", "ca")
    cert, key = pki.issue("server")
    (port,) = free_ports(1)
    args = (
        "--allow-grpc",
        "false",
        "--openai-port",
        str(port),
        "--http-use-ssl",
        "--http-server-cert",
        cert,
        "--http-server-key",
        key,
    )
    with NaiadProcess(repo, *args) as proc:
        for p in (proc.http_port, port):
            c = openai.OpenAI(
                base_url=f"https://localhost:{p}/v1",
                api_key="x",
                http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=pki.ca)),
            )
            r = c.chat.completions.create(
                model="counting_vllm", messages=[{"role": "user", "content": "x"}], max_tokens=1
            )
            assert r.choices[0].message.content == " tok0"
            with pytest.raises(requests.exceptions.ConnectionError):
                requests.get(f"http://127.0.0.1:{p}/v1/models", timeout=5)


# ---- the context check, with a model that publishes its tokenizer ----


def test_context_length_is_checked_with_the_published_tokenizer():
    import asyncio
    from types import SimpleNamespace

    from naiad.frontends.llm.errors import LLMError
    from naiad.frontends.llm.request import Generation
    from naiad.frontends.llm.service import LLMService
    from naiad.llm.info import LLMInfo, publish

    ctx = SimpleNamespace(extra={})
    publish(ctx, LLMInfo(context_length=8, tokenize=lambda text: text.split()))
    mv = SimpleNamespace(name="m", ctx=ctx)
    front = LLMService(server=None)
    gen = Generation(model="m", prompt="a b c")
    count = asyncio.run(front.prompt_tokens(mv, "a b c", gen))
    assert count == 3 and gen.max_tokens == 5  # the context's rest
    with pytest.raises(LLMError) as info:
        asyncio.run(front.prompt_tokens(mv, "a b c", Generation(model="m", prompt="a b c", max_tokens=6)))
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    with pytest.raises(LLMError) as info:
        asyncio.run(front.prompt_tokens(mv, " ".join("x" * 8), Generation(model="m", prompt="...")))
    assert info.value.code == "context_length_exceeded" and info.value.status == 400
