"""Structured output on llama.cpp models: `response_format` (json_schema, json_object) and forced tool calls
(`tool_choice` "required" or a named function) over the OpenAI API, constrained by a GBNF grammar, on a tiny
random-weight GGUF; the generate extension's `structured_outputs` sampling parameter; schemas llama.cpp cannot
follow are 400s naming the field.

A random model under a grammar closes the JSON only if the grammar leaves it no unbounded choice, so the schemas
here have enums, booleans, integers, short strings and no additional properties: every output ends within
MAX_TOKENS and the finish reason is "stop"."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests
from helpers import NaiadProcess
from llm_models import write_llamacpp_model
from openai_clients import v1_client

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)"
)
pytestmark = pytest.mark.timeout(240)

GGUF = "tiny_llama"
MAX_TOKENS = 160
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
        "tag": {"type": "string", "maxLength": 4},
    },
    "required": ["ok", "color", "count", "tag"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "Answer in JSON: the sky and the sea"}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("structured") / "models"
    write_llamacpp_model(repo / GGUF)
    with NaiadProcess(repo, "--allow-grpc", "false", timeout=180) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    with v1_client(server) as c:
        yield c


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chat_json_schema_whole_and_streamed(client, seed):
    whole = client.chat.completions.create(
        model=GGUF, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=seed, response_format=RESPONSE_FORMAT
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)

    stream = client.chat.completions.create(
        model=GGUF,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        seed=seed,
        response_format=RESPONSE_FORMAT,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # the same seed: the same text, whole or streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_greedy_chat_json_schema(client):
    out = client.chat.completions.create(
        model=GGUF, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, response_format=RESPONSE_FORMAT
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_completions_json_schema_whole_and_streamed(client):
    kwargs = dict(
        model=GGUF,
        prompt="Here is the answer as JSON:",
        max_tokens=MAX_TOKENS,
        seed=5,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].text), SCHEMA)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_is_one_json_object(client):
    # any JSON object: a random model that opens a string rarely closes it before max_tokens (some seeds do), so
    # ten seeded choices: every one that ends is a JSON object, every one cut short starts as one
    greedy = client.chat.completions.create(
        model=GGUF,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    ).choices[0]
    seeded = client.chat.completions.create(
        model=GGUF,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        seed=0,
        n=10,
        response_format={"type": "json_object"},
    ).choices
    ended = [c for c in [greedy, *seeded] if c.finish_reason == "stop"]
    assert len(ended) >= 3, [c.finish_reason for c in seeded]
    for choice in ended:
        assert isinstance(json.loads(choice.message.content), dict)
    for choice in seeded:
        assert choice.finish_reason in ("stop", "length") and choice.message.content.lstrip().startswith("{")


def test_unconstrained_text_is_not_json(client):
    # the grammar is what makes the JSON above: the same request without it gives the random model's text
    out = client.chat.completions.create(model=GGUF, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=1)
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_call(client, tool_choice):
    out = client.chat.completions.create(
        model=GGUF,
        messages=[{"role": "user", "content": "What is the weather?"}],
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=MAX_TOKENS,
        seed=3,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


def test_forced_tool_call_streamed(client):
    stream = client.chat.completions.create(
        model=GGUF,
        messages=[{"role": "user", "content": "What is the weather?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        seed=4,
        stream=True,
    )
    chunks = list(stream)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_schemas_llama_cpp_cannot_follow_are_400s_naming_the_field(server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    r = post(server, "/v1/chat/completions", {"model": GGUF, "messages": MESSAGES, "response_format": bad})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "grammar" in err["message"], err
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    body = {"model": GGUF, "messages": MESSAGES, "tools": [tool], "tool_choice": "required"}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    # min_tokens would ban the end the grammar needs
    body = {"model": GGUF, "messages": MESSAGES, "response_format": RESPONSE_FORMAT, "min_tokens": 4}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"], r.text


def test_generate_extension_takes_structured_outputs(server):
    def generate(structured) -> requests.Response:
        params = {"max_tokens": 32, "seed": 9, "structured_outputs": json.dumps(structured)}
        body = {
            "text_input": "Pick one:",
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params),
        }
        return requests.post(f"{server.url}/v2/models/{GGUF}/generate", json=body, timeout=60)

    choices = ["yes", "no", 'say "maybe"']
    for seed_choice in range(3):
        r = generate({"choice": choices})
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] in choices, seed_choice
    r = generate({"grammar": 'root ::= "a" "b"+'})
    assert r.status_code == 200 and r.json()["text_output"].startswith("ab"), r.text
    r = generate({"regex": r"[a-z]{3}-\d{2}"})
    assert r.status_code == 200 and re.fullmatch(r"[a-z]{3}-\d{2}", r.json()["text_output"]), r.text
    for bad, words in (
        ({"grammar": "root ::= ("}, "could not parse the grammar"),
        ({"regex": "(?=a)a"}, "lookahead"),
        ({"structural_tag": {"format": "x"}}, "not supported"),
        ({"json": {"type": "object"}, "choice": ["a"]}, "exactly one"),
    ):
        r = generate(bad)
        assert r.status_code == 400 and words in r.json()["error"], r.text


REGEXES = [
    r"[a-z]{3}-\d{2}",
    r"(cat|dog)s? [0-9]{1,3}!",
    r"\w{2,5}@[a-z]{1,4}\.(com|org)",
    r'say "[^"\n]{0,4}"',
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_vllm_structured_outputs_regex_whole_and_streamed(client, pattern):
    """vLLM's `structured_outputs` {"regex": ...} (the openai client's extra_body): every output is a whole match;
    streamed, the same seed gives the same text."""
    for seed in (1, 2):
        kwargs = dict(model=GGUF, prompt="An id:", max_tokens=MAX_TOKENS, seed=seed)
        body = {"structured_outputs": {"regex": pattern}}
        whole = client.completions.create(extra_body=body, **kwargs)
        assert whole.choices[0].finish_reason == "stop", whole
        assert re.fullmatch(pattern, whole.choices[0].text), (pattern, whole.choices[0].text)
        chunks = list(client.completions.create(stream=True, extra_body=body, **kwargs))
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_vllm_guided_fields_and_their_errors(client, server):
    """The older guided_regex / guided_choice / guided_json fields work the same; a pattern a grammar cannot
    follow, a request that also sets response_format, and a malformed field are 400s naming the field."""
    out = client.chat.completions.create(
        model=GGUF,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        seed=3,
        extra_body={"guided_regex": r"(yes|no)\."},
    )
    assert re.fullmatch(r"(yes|no)\.", out.choices[0].message.content), out
    out = client.chat.completions.create(
        model=GGUF,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        seed=3,
        extra_body={"guided_choice": ["up", "down"]},
    )
    assert out.choices[0].message.content in ("up", "down")
    out = client.chat.completions.create(
        model=GGUF, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=1, extra_body={"guided_json": SCHEMA}
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    for extra, words in (
        ({"structured_outputs": {"regex": r"(a)\1"}}, "backreference"),
        ({"guided_regex": "(a{1000}){1000}"}, "repeats too much"),
        ({"guided_regex": "(unclosed"}, "not a valid regular expression"),
        ({"structured_outputs": "a+"}, "must be an object"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "give one"),
    ):
        r = post(server, "/v1/chat/completions", {"model": GGUF, "messages": MESSAGES, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "structured_outputs" and words in err["message"], err


def test_tensorrt_llm_guide_types():
    from naiad.frontends.llm.errors import LLMError
    from naiad.frontends.llm.mapping import trtllm_guide

    assert trtllm_guide({"json": {"type": "object"}}) == ("json_schema", '{"type": "object"}')
    assert trtllm_guide({"json_object": True}) == ("json", "{}")
    assert trtllm_guide({"regex": "a+"}) == ("regex", "a+")
    assert trtllm_guide({"grammar": 'root ::= "a"'}) == ("ebnf_grammar", 'root ::= "a"')
    for spec in ({"choice": ["a"]}, {"regex": "a", "grammar": "b"}, {"regex": 1}):
        with pytest.raises(LLMError, match="TensorRT-LLM"):
            trtllm_guide(spec)
