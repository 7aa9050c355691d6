"""Structured output on the transformers backend (backends/transformers/grammar.py, xgrammar): a tiny random-weight
llama with a byte-level tokenizer answers JSON that validates against the schema, whole matches of a regex, one of
the choices, greedy and seeded, streamed and not, over the OpenAI API and the generate extension; what xgrammar
cannot compile is a 400 naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import requests
from helpers import NaiadProcess
from llm_models import write_tiny_hf_llama
from openai_clients import v1_client

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "the quick brown fox, as JSON"}]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo: Path = tmp_path_factory.mktemp("transformers_structured") / "models"
    (repo / "tiny" / "1").mkdir(parents=True)
    (repo / "tiny" / "config.pbtxt").write_text(
        'backend: "transformers"\ninstance_group [ { count: 1 kind: KIND_CPU } ]\n'
        'parameters: { key: "max_num_seqs" value: { string_value: "8" } }\n'
    )
    write_tiny_hf_llama(repo / "tiny" / "1", byte_level=True)
    with NaiadProcess(repo, "--allow-grpc", "false", timeout=180) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    with v1_client(server) as c:
        yield c


def test_unconstrained_output_is_not_json(client):
    """The random model left alone does not write JSON: what the tests below see is the grammar's doing."""
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, seed=1)
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content)


@pytest.mark.parametrize("seed", [1, 2, None])
def test_json_schema_whole_and_streamed(client, seed):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, response_format=FORMAT)
    kwargs.update({"seed": seed} if seed is not None else {"temperature": 0})
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop", whole
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_regex_choice_and_json_object(client):
    for seed in (1, 2, 3):
        body = {"structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}}
        out = client.completions.create(
            model="tiny", prompt="id:", max_tokens=MAX_TOKENS, seed=seed, extra_body=body
        )
        assert re.fullmatch(r"[a-z]{3}-\d{2}", out.choices[0].text), out.choices[0].text
        out = client.completions.create(
            model="tiny",
            prompt="pick:",
            max_tokens=MAX_TOKENS,
            seed=seed,
            extra_body={"guided_choice": ["up", "down"]},
        )
        assert out.choices[0].text in ("up", "down")
    out = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        seed=4,
        response_format={"type": "json_object"},
    )
    if out.choices[0].finish_reason == "stop":  # any JSON object may outgrow max_tokens on a random model
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.startswith("{")


def test_constrained_and_free_requests_share_batches(client):
    """Constrained rows are masked, the others in the same forward are not."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int):
        if i % 2:
            return client.completions.create(model="tiny", prompt="x", max_tokens=16, seed=i)
        body = {"structured_outputs": {"choice": ["alpha", "beta"]}}
        return client.completions.create(model="tiny", prompt="x", max_tokens=16, seed=i, extra_body=body)

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    assert all(outs[i].choices[0].text in ("alpha", "beta") for i in range(0, 8, 2))
    assert all(outs[i].choices[0].text not in ("alpha", "beta") for i in range(1, 8, 2))


def test_generate_extension_and_errors(server):
    params = {"max_tokens": 32, "seed": 3, "structured_outputs": json.dumps({"regex": "(yes|no)!"})}
    body = {"text_input": "ok?", "exclude_input_in_output": True, "sampling_parameters": json.dumps(params)}
    r = requests.post(f"{server.url}/v2/models/tiny/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["text_output"] in ("yes!", "no!"), r.text
    for extra, words in (
        ({"structured_outputs": {"regex": "(unclosed"}}, "xgrammar cannot compile"),
        ({"structured_outputs": {"structural_tag": {"x": 1}}}, "not supported by the transformers backend"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ):
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, **extra}
        r = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"], r.json()
