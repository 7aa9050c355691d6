"""The llamacpp backend's `structured_outputs` to GBNF (backends/llamacpp/grammar.py): which specs are taken, which
are refused and why, the LRU cache of converted schemas, and an engine that follows the grammar."""

from __future__ import annotations

import json
import threading

import pytest
from llm_models import write_tiny_gguf

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)"
)

from naiad.backends.llamacpp import grammar
from naiad.backends.llamacpp.params import sampling_params
from naiad.errors import InvalidArgument


def test_nothing_asked_is_no_grammar():
    assert grammar.structured_grammar(None) is None
    assert sampling_params({"max_tokens": 3}).grammar is None


def test_a_schema_is_converted_once():
    schema = {"type": "object", "properties": {"unique_name_for_cache_test": {"type": "boolean"}}}
    before = grammar._schema_grammar.cache_info()
    first = grammar.structured_grammar({"json": schema})
    again = grammar.structured_grammar(json.dumps({"json": json.dumps(schema)}))  # text, as vLLM takes it too
    after = grammar._schema_grammar.cache_info()
    assert first == again and "unique_name_for_cache_test" in first
    assert after.misses - before.misses == 1 and after.hits - before.hits == 1


def test_json_strings_exclude_control_characters():
    text = grammar.structured_grammar({"json": {"type": "string", "maxLength": 3}})
    assert "\\x00-\\x1F" in next(line for line in text.splitlines() if line.startswith("char ::="))


def test_choice_literals_are_escaped():
    text = grammar.structured_grammar({"choice": ['say "hi"', "a\\b", "x\ny"]})
    assert text == 'root ::= "say \\"hi\\"" | "a\\\\b" | "x\\ny"\n'


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"structural_tag": {"format": "x"}}, "not supported"),
        ({"regex": "(?<=a)b"}, "lookahead or lookbehind"),
        ({"regex": "(?i)abc"}, "inline flags"),
        ({"regex": "a\\bb"}, "anchors and word boundaries"),
        ({"regex": "[\\W_]"}, "negated class"),
        ({"regex": "((a{100}){100}){100}"}, "repeats too much"),
        ({"regex": ""}, "non-empty string"),
        ({"regex": "(a*)*"}, "repeats something that can match nothing"),
        ({"regex": "(|a)+b"}, "repeats something that can match nothing"),
        ({"grammar": 'root ::= ("a"?)+'}, "repeats something that can match nothing"),
        ({"grammar": 'root ::= x "b"\nx ::= y x | "a"\ny ::= ""?'}, "left recursion"),
        ({}, "exactly one"),
        ({"json": {"type": "object"}, "grammar": "root ::= x"}, "exactly one"),
        ({"json": {"type": "integer", "maximum": 3}}, "'maximum'"),
        ({"json": {"type": "object", "properties": {"a": {"not": {}}}}}, "at '/properties/a'"),
        ({"json": {"type": "nonsense"}}, "cannot turn this JSON schema"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"choice": []}, "non-empty list"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_refused_specs(spec, words):
    with pytest.raises(InvalidArgument, match=words):
        grammar.structured_grammar(spec)


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"^[a-z]{3}-\d{2}$", 'root ::= ([a-z]){3} "-" ([0-9]){2}\n'),
        (r"(?:ab)+c*?", 'root ::= ("ab")+ ("c")*\n'),
        (r"\w+@x\.com", 'root ::= ([0-9A-Z_a-z])+ "@x.com"\n'),
        (r"[^-^\]]x.", 'root ::= [^\\x2D\\x5E\\]] "x" [^\\x0A]\n'),
        ('say "\\\\" \t', 'root ::= "say \\"\\\\\\" \\x09"\n'),
        ("\u00e9\U0001f600", 'root ::= "\u00e9\\U0001F600"\n'),
    ],
)
def test_regex_to_gbnf(pattern, expected):
    from llama_cpp import LlamaGrammar

    text = grammar.structured_grammar({"regex": pattern})
    assert text == expected
    LlamaGrammar.from_string(text, verbose=False)  # llama.cpp's own parser takes it


def test_a_property_named_like_a_keyword_is_no_keyword():
    schema = {"type": "object", "properties": {"maximum": {"type": "boolean"}}, "required": ["maximum"]}
    assert "maximum" in grammar.structured_grammar({"json": schema})


def test_grammar_with_ignore_eos_is_refused():
    params = {"structured_outputs": json.dumps({"json_object": True}), "ignore_eos": True}
    with pytest.raises(InvalidArgument, match="ignore_eos"):
        sampling_params(params)


def test_the_engine_follows_the_grammar(tmp_path):
    from naiad.backends.llamacpp.engine import GenerationRequest, LlamaEngine
    from naiad.backends.llamacpp.params import EngineSettings

    engine = LlamaEngine(
        write_tiny_gguf(tmp_path / "m.gguf"), EngineSettings(n_ctx=128, n_parallel=2, n_threads=1)
    )
    try:
        with pytest.raises(InvalidArgument, match="could not parse the grammar"):
            engine.check_grammar("root ::= (")
        results = {}
        done = threading.Semaphore(0)

        def run(i: int, spec: dict | None) -> None:
            params = {"max_tokens": 24, "seed": i}
            if spec is not None:
                params["structured_outputs"] = json.dumps(spec)
            out: list[str] = []

            def emit(o):
                out.append(o.text)
                if o.finish_reason is not None:
                    results[i] = ("".join(out), o.finish_reason)
                    done.release()

            sp = sampling_params(params)
            engine.submit(GenerationRequest(engine.tokenize("Pick:"), sp, emit, lambda e: done.release()))

        for i in range(4):  # constrained and free sequences share a batch
            run(i, {"choice": ["alpha", "beta"]} if i % 2 == 0 else None)
        for _ in range(4):
            assert done.acquire(timeout=30)
        for i in (0, 2):
            assert results[i] == (results[i][0], "stop") and results[i][0] in ("alpha", "beta")
        assert all(results[i][0] not in ("alpha", "beta") for i in (1, 3))
    finally:
        engine.close()


def test_grammars_that_would_crash_llama_cpp_never_reach_it(tmp_path):
    """A repetition of something that can match nothing sends llama.cpp's grammar setup into endless recursion (a
    segmentation fault of the whole server, seen with ("a"*)*): the engine refuses it first, and keeps serving."""
    from naiad.backends.llamacpp.engine import LlamaEngine
    from naiad.backends.llamacpp.params import EngineSettings

    engine = LlamaEngine(
        write_tiny_gguf(tmp_path / "m.gguf"), EngineSettings(n_ctx=64, n_parallel=1, n_threads=1)
    )
    try:
        for spec in (
            {"grammar": 'root ::= ("a"*)*'},
            {"regex": "((a?)*)*"},
            {"grammar": 'root ::= ("" | "a")*'},
        ):
            with pytest.raises(InvalidArgument, match="can match nothing"):
                sampling_params({"structured_outputs": json.dumps(spec)})
        for spec in ({"grammar": 'root ::= ("a" | "b")* "c"'}, {"regex": "(ab?)*c"}, {"json_object": True}):
            engine.check_grammar(grammar.structured_grammar(spec) or "")  # llama.cpp takes these
    finally:
        engine.close()
