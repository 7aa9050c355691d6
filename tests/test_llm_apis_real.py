"""The APIs agents call, on a real model: SmolLM2-135M-Instruct (Q4_1 GGUF) served by `backend: "llamacpp"` and
driven by the official clients unchanged: the `openai` client's Responses API (plain, streamed, a function tool, a
conversation by `previous_response_id`), the `anthropic` client's Messages API (plain, streamed, a tool), the
OpenAI Agents SDK's `OpenAIResponsesModel`; vLLM's /tokenize and /detokenize against llama.cpp's own tokenizer, and
a greedy completion against llama.cpp's own generation of the same prompt."""

from __future__ import annotations

import asyncio
import json

import pytest
import requests
from helpers import NaiadProcess
from real_models import link_version, smollm2_gguf

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)"
)

MODEL = "smollm2"
CONFIG = (
    'backend: "llamacpp"\n'
    'parameters { key: "n_ctx" value: { string_value: "2048" } }\n'
    'parameters { key: "n_parallel" value: { string_value: "2" } }\n'
    'parameters { key: "n_threads" value: { string_value: "1" } }\n'
)
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("real_llm_repo")
    link_version(repo, MODEL, smollm2_gguf(), CONFIG)
    with NaiadProcess(repo, "--allow-grpc", "false", timeout=180) as proc:
        yield proc


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """llama.cpp's own generation, in this process: the high-level `Llama` of the same llama-cpp-python, with flash
    attention as llama.cpp's server and Naiad's engine run it (llama.cpp's "auto": on, on a CPU)."""
    llm = llama_cpp.Llama(str(smollm2_gguf()), n_ctx=2048, n_threads=1, flash_attn=True, verbose=False)
    yield llm
    llm.close()


# ---- tokenize, and llama.cpp's own greedy output ----


def test_tokenize_is_llama_cpps_own_and_detokenize_inverts_it(server, reference):
    text = "The capital of France is Paris. Naïve café, 🦙!"
    r = requests.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == reference.tokenize(text.encode(), add_bos=True, special=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    back = requests.post(
        f"{server.url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}, timeout=60
    )
    assert back.status_code == 200 and back.json()["prompt"].strip() == text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True}
    r = requests.post(f"{server.url}/tokenize", json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > 3 and "".join(r.json()["token_strs"]).count("Hi") == 1


def test_a_greedy_completion_is_llama_cpps_own(oai, reference):
    prompt = "The three primary colors are"
    ours = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    theirs = reference.create_completion(prompt, max_tokens=16, temperature=0.0)
    assert ours.choices[0].text == theirs["choices"][0]["text"]


# ---- the Responses API ----


def test_responses_create_and_a_conversation_by_previous_response_id(oai):
    first = oai.responses.create(
        model=MODEL, input="Say hello in French.", max_output_tokens=16, temperature=0
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    second = oai.responses.create(
        model=MODEL,
        input="And in Spanish?",
        previous_response_id=first.id,
        max_output_tokens=16,
        temperature=0,
    )
    assert second.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn came along
    assert oai.responses.retrieve(first.id).id == first.id
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)


def test_responses_stream_with_the_clients_accumulator(oai):
    deltas, last = [], None
    with oai.responses.stream(
        model=MODEL, input="Count to five.", max_output_tokens=24, temperature=0
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                last = event  # (a response cut by max_output_tokens ends incomplete, as OpenAI's do)
        if last is not None and last.type == "response.completed":
            assert stream.get_final_response().output_text == "".join(deltas)
    assert deltas and last is not None and last.response.output_text == "".join(deltas)


def test_responses_with_a_function_tool(oai):
    response = oai.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[{"type": "function", **WEATHER}],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    # the tool's result in the next turn
    follow = oai.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}],
        max_output_tokens=16,
        temperature=0,
    )
    assert follow.output_text


def test_the_agents_sdk_runs_on_naiad(server):
    agents = pytest.importorskip("agents")
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = agents.Agent(
        name="greeter",
        instructions="Answer in one short sentence.",
        model=model,
        # (stopped at the end of its first line: a 135M model may ramble past any small max_tokens)
        model_settings=agents.ModelSettings(max_tokens=128, temperature=0, extra_body={"stop": ["\n"]}),
    )
    result = asyncio.run(agents.Runner.run(agent, "Say hello."))
    assert isinstance(result.final_output, str) and result.final_output


# ---- Anthropic's Messages API ----


def test_messages_create_and_count_tokens(claude):
    message = claude.messages.create(
        model=MODEL,
        max_tokens=16,
        system="You are brief.",
        messages=[{"role": "user", "content": "Name a fruit."}],
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    count = claude.messages.count_tokens(
        model=MODEL, system="You are brief.", messages=[{"role": "user", "content": "Name a fruit."}]
    )
    assert count.input_tokens == message.usage.input_tokens


def test_messages_stream(claude):
    with claude.messages.stream(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Count to three."}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")


def test_messages_with_a_tool(claude):
    tool = {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "input_schema": WEATHER["parameters"],
    }
    message = claude.messages.create(
        model=MODEL,
        # room for a longer call: one make test run stopped at 64 tokens (max_tokens) before the call was complete,
        # a greedy path that passes alone (a near tie, perhaps, over KV cells reused from another batch)
        max_tokens=256,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Rome?"}],
    )
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=16,
        tools=[tool],
        messages=[
            {"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": message.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Rainy"}],
            },
        ],
    )
    assert reply.content


def test_bad_input_gets_anthropics_error_object(server, claude):
    r = requests.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "robot", "content": "hi"}])
