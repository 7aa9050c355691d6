"""The LLM APIs beside chat completions, on the deterministic counting models (tests/openai_models.py): reasoning and
Hermes tool calls shaped by a model's configured parsers in every API, the Responses API's store, background runs
and cancel, and bad input on each new endpoint answered in that API's own error object, never a 500."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests
from helpers import NaiadProcess
from openai_models import build

from naiad.frontends.openai.responses import ResponseStore, Stored

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.timeout(180)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo: Path = build(tmp_path_factory.mktemp("llm_apis") / "models")
    with NaiadProcess(repo, "--allow-grpc", "false", "--openai-stall-timeout", "5") as proc:
        yield proc


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


# ---- reasoning and tool calls, by the model's parsers ----


def test_reasoning_content_in_chat_whole_and_streamed(oai):
    messages = [{"role": "user", "content": "THINK please"}]
    whole = oai.chat.completions.create(model="thinking_vllm", messages=messages, max_tokens=3)
    message = whole.choices[0].message
    assert message.reasoning_content == "Let me count." and message.content == " tok0 tok1 tok2"
    stream = oai.chat.completions.create(model="thinking_vllm", messages=messages, max_tokens=3, stream=True)
    thought, said = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            said += delta.content or ""
    assert thought == "Let me count." and said == " tok0 tok1 tok2"
    # a model without a reasoning parser: the tags are content
    plain = oai.chat.completions.create(model="counting_vllm", messages=messages, max_tokens=1)
    assert plain.choices[0].message.content.startswith("<think>")


def test_hermes_tool_calls_after_text_whole_and_streamed(oai):
    messages = [{"role": "user", "content": "HERMES weather in Oslo?"}]
    whole = oai.chat.completions.create(model="thinking_vllm", messages=messages, tools=[WEATHER])
    choice = whole.choices[0]
    # (the text before the call, as vLLM's hermes parser leaves it)
    assert choice.finish_reason == "tool_calls" and choice.message.content.strip() == "Checking."
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert '"Oslo"' in choice.message.tool_calls[0].function.arguments
    chunks = list(
        oai.chat.completions.create(model="thinking_vllm", messages=messages, tools=[WEATHER], stream=True)
    )
    said = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert said.strip() == "Checking." and [c.function.name for c in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_and_calls_in_the_responses_and_messages_apis(oai, claude):
    response = oai.responses.create(model="thinking_vllm", input="THINK please", max_output_tokens=2)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"] and response.output_text == " tok0 tok1"
    assert response.output[0].content[0].text == "Let me count."
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    called = oai.responses.create(model="thinking_vllm", input="HERMES weather?", tools=[tool])
    assert [item.type for item in called.output] == ["message", "function_call"]
    assert called.output[1].name == "get_weather"
    message = claude.messages.create(
        model="thinking_vllm", max_tokens=2, messages=[{"role": "user", "content": "THINK"}]
    )
    assert [b.type for b in message.content] == ["thinking", "text"] and message.content[
        0
    ].thinking == "Let me count."
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    used = claude.messages.create(
        model="thinking_vllm",
        max_tokens=64,
        tools=tools,
        messages=[{"role": "user", "content": "HERMES weather?"}],
    )
    assert used.stop_reason == "tool_use" and used.content[-1].input == {"city": "Oslo"}
    with claude.messages.stream(
        model="thinking_vllm", max_tokens=2, messages=[{"role": "user", "content": "THINK"}]
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == " tok0 tok1"


# ---- the Responses API's store, background runs, cancel ----


def test_a_background_response_is_read_back_and_can_be_cancelled(oai):
    started = oai.responses.create(
        model="counting_vllm", input="SLOW go", max_output_tokens=200, background=True
    )
    assert started.status in ("queued", "in_progress")
    cancelled = oai.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    done = oai.responses.create(model="counting_vllm", input="go", max_output_tokens=3, background=True)
    deadline = time.monotonic() + 30
    while oai.responses.retrieve(done.id).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
    final = oai.responses.retrieve(done.id)
    assert final.status == "incomplete" and final.output_text == " tok0 tok1 tok2"
    items = oai.responses.input_items.list(done.id)
    assert items.data[0].content[0].text == "go"
    with pytest.raises(openai.BadRequestError):  # a response that was not run in the background
        oai.responses.cancel(oai.responses.create(model="counting_vllm", input="go", max_output_tokens=1).id)


def test_the_store_is_bounded_in_number_and_bytes():
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(5):
        store.put(Stored({"id": f"r{i}"}, [], []))
    assert list(store.items) == ["r2", "r3", "r4"]
    store.put(Stored({"id": "big", "text": "x" * 6000}, [], []))
    store.put(Stored({"id": "bigger", "text": "x" * 6000}, [], []))
    assert "big" not in store.items and store.bytes <= 10_000
    with pytest.raises(Exception, match="not found"):
        store.get("r0")


# ---- bad input on every new endpoint: that API's error object, a 4xx ----


def _post(server, path: str, body, status: int = 400) -> dict:
    r = requests.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == status, (path, body, r.status_code, r.text)
    return r.json()


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "model"),
        ({"model": "counting_vllm"}, "input"),
        ({"model": "counting_vllm", "input": 7}, "input"),
        ({"model": "counting_vllm", "input": [{"type": "weird"}]}, "input[0]"),
        ({"model": "counting_vllm", "input": [{"role": "robot", "content": "x"}]}, "input[0]"),
        ({"model": "counting_vllm", "input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"model": "counting_vllm", "input": "x", "tool_choice": 5}, "tool_choice"),
        ({"model": "counting_vllm", "input": "x", "temperature": 9}, "temperature"),
        ({"model": "counting_vllm", "input": "x", "background": True, "store": False}, "background"),
        ({"model": "counting_vllm", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ],
)
def test_bad_responses_requests(server, body, param):
    error = _post(server, "/v1/responses", body)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_responses_that_do_not_exist(server):
    assert (
        _post(server, "/v1/responses", {"model": "nope", "input": "x"}, 404)["error"]["code"]
        == "model_not_found"
    )
    body = {"model": "counting_vllm", "input": "x", "previous_response_id": "resp_nope"}
    assert _post(server, "/v1/responses", body, 404)["error"]["param"] == "response_id"
    assert requests.get(f"{server.url}/v1/responses/resp_nope", timeout=30).status_code == 404
    assert requests.delete(f"{server.url}/v1/responses/resp_nope", timeout=30).json()["error"]["type"]


@pytest.mark.parametrize(
    "body, status",
    [
        ({"model": "counting_vllm", "messages": [{"role": "user", "content": "x"}]}, 400),  # no max_tokens
        ({"model": "counting_vllm", "max_tokens": 4, "messages": []}, 400),
        ({"model": "counting_vllm", "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, 400),
        (
            {
                "model": "counting_vllm",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "video"}]}],
            },
            400,
        ),
        (
            {
                "model": "counting_vllm",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "temperature": 3,
            },
            400,
        ),
        (
            {
                "model": "counting_vllm",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "any"},
            },
            400,
        ),
        ({"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, 404),
        ({"model": "plain", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, 400),
        ([1, 2], 400),
    ],
)
def test_bad_messages_requests_get_anthropics_error_object(server, body, status):
    doc = _post(server, "/v1/messages", body, status)
    assert doc["type"] == "error" and doc["error"]["message"]
    assert doc["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_bad_json_and_unknown_routes_in_each_apis_words(server):
    r = requests.post(f"{server.url}/v1/messages", data=b"{nope", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = requests.get(f"{server.url}/v1/messages", timeout=30)  # a method it does not take
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = requests.post(f"{server.url}/v1/responses", data=b"{nope", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/tokenize", {"prompt": "x"}, 400),
        ("/tokenize", {"model": "counting_vllm", "prompt": "x"}, 400),  # publishes no tokenizer
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
        ("/detokenize", {"model": "counting_vllm", "tokens": "abc"}, 400),
        ("/v1/score", {"model": "plain", "text_1": "a", "text_2": ["b"]}, 400),  # no embeddings
        ("/v1/score", {"model": "counting_vllm", "text_1": ["a", "b"], "text_2": ["c"]}, 400),
        ("/v1/rerank", {"model": "counting_vllm", "query": "", "documents": ["a"]}, 400),
        ("/v1/rerank", {"model": "counting_vllm", "query": "q", "documents": [3]}, 400),
        ("/v1/rerank", {"model": "counting_vllm", "query": "q", "documents": ["a"], "top_n": 0}, 400),
        ("/v1/rerank", {"model": "nope", "query": "q", "documents": ["a"]}, 404),
    ],
)
def test_bad_extras_requests(server, path, body, status):
    error = _post(server, path, body, status)["error"]
    assert error["message"] and error["type"] in ("invalid_request_error",)


def test_server_log_has_no_tracebacks(server):
    """Everything above was answered without an unhandled error."""
    assert "Traceback" not in server.output()
