"""Speculative decoding in the llama.cpp engine (backends/llamacpp/speculative.py) on tiny random-weight GGUFs: the
model as its own draft (every draft token accepted), a draft close to it (`noise`: some accepted), prompt lookup on
a repetitive prompt; the output is the same as without speculation (greedy and seeded sampling, logprobs, stop
strings, structured output, several slots at once), the counters add up, an incompatible draft fails the load, and
`naiad serve` takes the parameters and exports vLLM's spec_decode counters."""

from __future__ import annotations

import json
import re
import threading
from types import SimpleNamespace

import pytest
import requests
from helpers import NaiadProcess
from llm_models import write_llama_gguf, write_tiny_gguf

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)"
)

PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. What is the capital of France?",
    "Count to ten: one, two, three",
    "Hello world, this is a tiny language model",
]
# prompt lookup's case: a continuation that repeats what came before
REPEAT = "one, two, three, four, five, six. one, two, three, four, five, six. one, two, three, four, five, six. one,"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return SimpleNamespace(
        target=write_tiny_gguf(d / "target.gguf"),
        close=write_llama_gguf(d / "close.gguf", noise=0.1),  # the target's weights plus a tenth of others
        # another vocabulary: fewer merges, so the special tokens sit at other ids and token texts differ
        foreign=write_llama_gguf(d / "foreign.gguf", n_merges=100),
    )


def _engine(path, n_parallel: int = 4, n_ctx: int = 256, **spec):
    from naiad.backends.llamacpp.engine import LlamaEngine
    from naiad.backends.llamacpp.params import EngineSettings

    return LlamaEngine(path, EngineSettings(n_ctx=n_ctx, n_parallel=n_parallel, n_threads=1, **spec))


def _run(engine, prompt: str, n: int = 40, **sampling) -> tuple:
    """(text, finish reason, tokens, logprobs) of one request."""
    from naiad.backends.llamacpp.engine import GenerationRequest
    from naiad.backends.llamacpp.params import SamplingParams

    sampling = {"temperature": 0.0, **sampling}
    n = sampling.pop("max_tokens", n)
    out: list[str] = []
    lps: list[dict] = []
    state = {"finish": None, "tokens": 0}
    done = threading.Event()
    failed: list[BaseException] = []

    def emit(o):
        out.append(o.text)
        lps.extend(o.logprobs or [])
        state["tokens"] += o.tokens
        if o.finish_reason is not None:
            state["finish"] = o.finish_reason
            done.set()

    def fail(exc):
        failed.append(exc)
        done.set()

    engine.submit(
        GenerationRequest(engine.tokenize(prompt), SamplingParams(max_tokens=n, **sampling), emit, fail)
    )
    assert done.wait(120)
    assert not failed, failed
    return "".join(out), state["finish"], state["tokens"], lps


def _runs(engine, cases: list[tuple[str, dict]]) -> list[tuple]:
    return [_run(engine, prompt, **sampling) for prompt, sampling in cases]


def _concurrently(engine, cases: list[tuple[str, dict]]) -> list[tuple]:
    results: list = [None] * len(cases)
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, _run(engine, cases[i][0], **cases[i][1])))
        for i in range(len(cases))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def _counters_add_up(s) -> None:
    assert 0 <= s.accepted <= s.draft_tokens
    assert s.drafts <= s.draft_tokens <= s.drafts * s.max
    assert sum(s.accepted_per_pos) == s.accepted
    assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:]))  # position i needs i-1
    assert s.accepted_per_pos[0] <= s.drafts


GREEDY = [(p, {"ignore_eos": True}) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(files):
    """What the engine generates without speculation (the reference)."""
    engine = _engine(files.target)
    try:
        yield SimpleNamespace(
            greedy=_runs(engine, GREEDY),
            repeat=_run(engine, REPEAT, 48, ignore_eos=True),
        )
    finally:
        engine.close()


def test_the_model_as_its_own_draft_accepts_every_token(files, plain):
    engine = _engine(files.target, speculative_model=str(files.target), speculative_max=4)
    try:
        assert _runs(engine, GREEDY) == plain.greedy
        s = engine.speculator
        _counters_add_up(s)
        assert s.drafts > 0 and s.accepted == s.draft_tokens  # acceptance 100%
        assert s.accepted_per_pos[0] == s.drafts
        # each step drafted (at most) speculative_max: 40 tokens a request in about 40 / 5 steps
        assert s.drafts <= len(GREEDY) * 10
        # the draft context drafts for all its sequences at once: a handful of decodes a step, not one per slot
        assert engine.speculator.draft_model.decodes <= s.drafts * 5
    finally:
        engine.close()


def test_a_draft_close_to_the_model_accepts_some(files, plain):
    engine = _engine(files.target, speculative_model=str(files.close), speculative_max=3)
    try:
        assert _runs(engine, GREEDY) == plain.greedy
        s = engine.speculator
        _counters_add_up(s)
        assert 0 < s.accepted < s.draft_tokens  # partial acceptance
        assert s.max == 3 and len(s.accepted_per_pos) == 3
    finally:
        engine.close()


def test_prompt_lookup_on_a_repetitive_prompt(files, plain):
    engine = _engine(files.target, speculative_ngram=3, speculative_ngram_min=1, speculative_max=5)
    try:
        assert _runs(engine, GREEDY) == plain.greedy
        assert _run(engine, REPEAT, 48, ignore_eos=True) == plain.repeat
        s = engine.speculator
        _counters_add_up(s)
        assert s.drafts > 0 and s.accepted > 0
        assert s.draft_model is None
    finally:
        engine.close()


def test_several_slots_at_once_give_what_each_gives_alone(files, plain):
    cases = GREEDY + [(REPEAT, {"ignore_eos": True})]
    for spec in (
        {"speculative_model": str(files.close)},
        {
            "speculative_model": str(files.target),
            "speculative_ngram": 2,
        },  # lookup first, the draft model else
    ):
        engine = _engine(files.target, **spec)
        try:
            alone = _runs(engine, cases)
            assert alone[:4] == plain.greedy
            together = _concurrently(engine, cases * 2)  # 10 requests on 4 slots
            assert together == alone * 2
            _counters_add_up(engine.speculator)
        finally:
            engine.close()


def test_sampling_stop_strings_structured_output_and_logprobs_are_unchanged(files):
    """Every request speculates: a seeded sampler samples the same tokens (its random stream advances once per
    kept token), a stop string ends the text where it would, a grammar constrains each kept token, logprobs come
    from each drafted position's logits (llama.cpp computes a batch of one sequence's positions with other kernels
    than one position: equal to about 1e-5 of the logits, a few 1e-4 of a logprob on this sharp model)."""
    from naiad.backends.llamacpp.grammar import structured_grammar

    cases = [
        (PROMPTS[0], {"temperature": 0.9, "seed": 7, "ignore_eos": True}),
        (PROMPTS[1], {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 3}),
        (PROMPTS[2], {"stop": ["the", "a"], "ignore_eos": True}),
        (PROMPTS[3], {"grammar": structured_grammar({"regex": "[a-z ]{5,30}\\."})}),
        (PROMPTS[1], {"grammar": structured_grammar({"json_object": True}), "max_tokens": 24}),
        (PROMPTS[0], {"min_tokens": 30}),
        (PROMPTS[2], {"max_tokens": 7, "ignore_eos": True}),  # ends inside a draft
    ]
    lp_cases = [(p, {"logprobs": 3, "ignore_eos": True}) for p in PROMPTS[:2]]
    plain = _engine(files.target)
    try:
        want = _runs(plain, cases)
        want_lp = _runs(plain, lp_cases)
    finally:
        plain.close()
    for spec in (
        {"speculative_model": str(files.target)},
        {"speculative_ngram": 2, "speculative_ngram_min": 1},
    ):
        engine = _engine(files.target, **spec)
        try:
            assert _runs(engine, cases) == want
            for (text, finish, n, lps), (w_text, w_finish, w_n, w_lps) in zip(
                _runs(engine, lp_cases), want_lp
            ):
                assert (text, finish, n) == (w_text, w_finish, w_n)
                for entry, w_entry in zip(lps, w_lps, strict=True):
                    assert list(entry) == list(w_entry)  # the sampled token first, then the same top ones
                    for token, info in entry.items():
                        assert info["logprob"] == pytest.approx(w_entry[token]["logprob"], abs=5e-3)
            assert engine.speculator.drafts > 0
            _counters_add_up(engine.speculator)
        finally:
            engine.close()


def test_the_context_end_is_where_it_is_without_speculation(files):
    """Drafts never reach past a sequence's n_ctx cells: a request that runs into the end finishes as it would."""
    prompt = PROMPTS[1]
    plain = _engine(files.target, n_parallel=1, n_ctx=64)
    try:
        room = 64 - len(plain.tokenize(prompt))
        want = _run(plain, prompt, max_tokens=room, ignore_eos=True)
    finally:
        plain.close()
    engine = _engine(
        files.target, n_parallel=1, n_ctx=64, speculative_model=str(files.target), speculative_max=6
    )
    try:
        got = _run(engine, prompt, max_tokens=room, ignore_eos=True)
        assert got == want and got[1] == "length"
        assert engine.speculator.drafts > 0
    finally:
        engine.close()


def test_an_incompatible_draft_fails_the_load(files, tmp_path):
    from naiad.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="cannot draft for this model: its BOS token differs"):
        _engine(files.target, speculative_model=str(files.foreign))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(InvalidArgument, match="could not load the draft model"):
        _engine(files.target, speculative_model=str(tmp_path / "junk.gguf"))


def test_parameters(tmp_path):
    from naiad.backends.llamacpp.params import engine_settings
    from naiad.errors import InvalidArgument

    (tmp_path / "draft.gguf").write_bytes(b"")
    s = engine_settings(
        {
            "speculative_model": "draft.gguf",
            "speculative_ngram": "4",
            "speculative_max": "6",
            "speculative_min": "2",
            "speculative_p_min": "0.5",
        },
        version_dir=tmp_path,
    )
    assert s.speculative_model == str(tmp_path / "draft.gguf")
    assert (s.speculative_ngram, s.speculative_ngram_min, s.speculative_max, s.speculative_min) == (
        4,
        0,
        6,
        2,
    )
    assert s.speculative_p_min == 0.5
    assert engine_settings({}).speculative_model == "" and engine_settings({}).speculative_ngram == 0
    for bad, why in (
        ({"speculative_model": "missing.gguf"}, "no draft GGUF"),
        ({"speculative_max": "0"}, "must be positive"),
        ({"speculative_min": "5", "speculative_max": "4"}, "more than 'speculative_max'"),
        ({"speculative_ngram": "2", "speculative_ngram_min": "3"}, "more than 'speculative_ngram'"),
        ({"speculative_p_min": "2"}, r"in \[0, 1\]"),
    ):
        with pytest.raises(InvalidArgument, match=why):
            engine_settings(bad, version_dir=tmp_path)


def _metric(naiad, name: str, **labels) -> float | None:
    text = requests.get(f"http://{naiad.metrics}/metrics", timeout=10).text
    for line in text.splitlines():
        m = re.match(r"^([^{ ]+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def test_naiad_serve_speculates_and_exports_vllms_counters(files, tmp_path):
    repo = tmp_path / "repo"
    params = 'parameters { key: "n_threads" value: { string_value: "1" } }\n'
    for name, extra in (
        ("plain", ""),
        ("spec", 'parameters { key: "speculative_model" value: { string_value: "draft.gguf" } }\n'),
        ("bad", 'parameters { key: "speculative_model" value: { string_value: "draft.gguf" } }\n'),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.gguf").symlink_to(files.target)
        (repo / name / "config.pbtxt").write_text('backend: "llamacpp"\n' + params + extra)
    (repo / "spec" / "1" / "draft.gguf").symlink_to(files.target)
    (repo / "bad" / "1" / "draft.gguf").symlink_to(files.foreign)
    with NaiadProcess(repo, "--strict-readiness", "false", "--allow-grpc", "false", timeout=120) as naiad:
        texts = {}
        for model in ("plain", "spec"):
            body = {
                "text_input": PROMPTS[0],
                "exclude_input_in_output": True,
                "sampling_parameters": json.dumps({"max_tokens": 24, "temperature": 0, "ignore_eos": True}),
            }
            r = requests.post(f"{naiad.url}/v2/models/{model}/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts[model] = r.json()["text_output"]
        assert texts["spec"] == texts["plain"]
        drafts = _metric(naiad, "vllm:spec_decode_num_drafts_total", model_name="spec")
        drafted = _metric(naiad, "vllm:spec_decode_num_draft_tokens_total", model_name="spec")
        accepted = _metric(naiad, "vllm:spec_decode_num_accepted_tokens_total", model_name="spec")
        assert drafts and drafted and drafted == accepted  # its own draft: everything accepted
        per_pos = [
            _metric(
                naiad,
                "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                model_name="spec",
                position=str(i),
            )
            for i in range(4)
        ]
        assert per_pos[0] == drafts and sum(per_pos) == accepted
        assert _metric(naiad, "vllm:spec_decode_num_drafts_total", model_name="plain") is None
        index = requests.post(f"{naiad.url}/v2/repository/index", json={}, timeout=10).json()
        bad = next(m for m in index if m["name"] == "bad")
        assert bad["state"] != "READY"
        assert "cannot draft for this model" in bad.get("reason", ""), bad
