"""Unit tests of the llamacpp backend's pure-Python parts: UTF-8-safe streaming text with stop strings, and the
parsing of `sampling_parameters` and config parameters (no llama.cpp needed)."""

from __future__ import annotations

import pytest

from naiad.backends.llamacpp.params import engine_settings, sampling_params
from naiad.backends.llamacpp.text import TextStream
from naiad.errors import InvalidArgument


def _run(stream: TextStream, chunks: list[bytes]) -> list[str]:
    out = [stream.push(c) for c in chunks]
    out.append(stream.finish())
    return out


def test_multibyte_characters_split_over_tokens_come_out_whole():
    data = "héllo 🦙!".encode()
    deltas = _run(TextStream([]), [data[i : i + 1] for i in range(len(data))])
    assert "".join(deltas) == "héllo 🦙!"
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_over_several_tokens_never_leaks():
    s = TextStream(["STOP"])
    deltas = _run(s, [b"abc S", b"T", b"O", b"P and more"])
    assert "".join(deltas) == "abc "
    assert s.stopped and s.text == "abc "
    assert all("S" not in d for d in deltas)


def test_a_held_back_prefix_that_is_not_a_stop_is_released():
    s = TextStream(["STOP"])
    deltas = _run(s, [b"ST", b"ART", b" end"])
    assert deltas[0] == ""  # "ST" may begin "STOP"
    assert "".join(deltas) == "START end"
    assert not s.stopped


def test_earliest_of_several_stops_wins():
    s = TextStream(["world", "lo w"])
    assert "".join(_run(s, [b"hello world"])) == "hel"


def test_sampling_parameters():
    sp = sampling_params(
        {
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 40,
            "seed": 7,
            "stop": "x",
            "ignore_eos": True,
            "min_tokens": 2,
            "n": 1,
        }
    )
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (5, 0.0, 0.9, 40, 7)
    assert sp.stop == ["x"] and sp.ignore_eos and sp.min_tokens == 2
    assert sampling_params({}).max_tokens is None
    for bad in (
        {"n": 2},
        {"max_tokens": 0},
        {"temperature": -1},
        {"top_p": 1.5},
        {"stop": [1]},
        {"best_of": 3},
        {"max_tokens": "many"},
    ):
        with pytest.raises(InvalidArgument):
            sampling_params(bad)


def test_engine_settings():
    s = engine_settings({"n_ctx": "256", "n_parallel": "2", "n_threads": "3", "other": "x"})
    assert (s.n_ctx, s.n_parallel, s.n_threads, s.n_batch, s.embeddings) == (256, 2, 3, 512, True)
    assert engine_settings({}).n_threads >= 1
    with pytest.raises(InvalidArgument, match="n_ctx"):
        engine_settings({"n_ctx": "big"})
    with pytest.raises(InvalidArgument, match="n_parallel"):
        engine_settings({"n_parallel": "0"})
    with pytest.raises(InvalidArgument, match="embeddings"):
        engine_settings({"embeddings": "maybe"})
