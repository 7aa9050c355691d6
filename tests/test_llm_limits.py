"""The LLM request bounds that need no engine: the prompt's byte bound (llm/limits.py), tokenizing off the event
loop within a deadline (llm/tokenizing.py), stop strings checked in time independent of their length
(backends/llamacpp/text.py), and SIGTERM acted on while the loop is blocked (stop_signals.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from naiad.backends.llamacpp.text import TextStream
from naiad.errors import InvalidArgument, Unavailable
from naiad.llm import limits, tokenizing
from naiad.llm.info import LLMInfo

ROOT = Path(__file__).resolve().parent.parent


def test_the_byte_bound_is_the_context_times_the_longest_token():
    assert limits.prompt_byte_limit(2048, 16) == 32768
    assert limits.prompt_byte_limit(2048, 16, normalizing=True) == 32768 * limits.NORMALIZING_FACTOR
    assert limits.prompt_byte_limit(2048, 16, max_prompt_bytes=1000) == 1000  # a parameter lowers it
    assert limits.prompt_byte_limit(2048, 16, max_prompt_bytes=10**9) == 32768  # and never raises it
    assert limits.prompt_byte_limit(None, None) is None
    assert limits.prompt_byte_limit(None, None, 500) == 500
    assert limits.max_token_bytes(["a", "héllo", b"\xff\xfe"]) == 6


def test_check_prompt_counts_bytes_not_characters():
    limits.check_prompt("a" * 100, 100)
    with pytest.raises(limits.PromptTooLong, match="101 bytes"):
        limits.check_prompt("a" * 101, 100)
    limits.check_prompt("é" * 50, 100)  # 100 bytes
    with pytest.raises(limits.PromptTooLong, match="102 bytes"):
        limits.check_prompt("é" * 51, 100, context_length=10)
    with pytest.raises(limits.PromptTooLong, match="maximum context length is 10 tokens"):
        limits.check_prompt(b"x" * 101, 100, context_length=10)
    limits.check_prompt("\ud800" * 10, 100)  # a lone surrogate (a JSON escape) is measured, not a crash
    limits.check_prompt("x" * 10**6, None)  # no bound known


def test_a_10mb_prompt_is_refused_without_being_encoded():
    text = "word " * 2_000_000
    start = time.perf_counter()
    for _ in range(100):
        with pytest.raises(limits.PromptTooLong):
            limits.check_prompt(text, 32768)
    assert (time.perf_counter() - start) / 100 < 0.001  # its length alone decides


def test_max_prompt_bytes_parameter():
    assert limits.max_prompt_bytes_parameter({}) is None
    assert limits.max_prompt_bytes_parameter({"max_prompt_bytes": " 4096 "}) == 4096
    for bad in ("0", "-1", "lots"):
        with pytest.raises(InvalidArgument, match="max_prompt_bytes"):
            limits.max_prompt_bytes_parameter({"max_prompt_bytes": bad})


def test_stop_strings_are_bounded():
    assert limits.check_stop(["a"] * limits.MAX_STOP_STRINGS)
    with pytest.raises(InvalidArgument, match="at most 64 strings"):
        limits.check_stop(["a"] * (limits.MAX_STOP_STRINGS + 1))
    with pytest.raises(InvalidArgument, match="at most 4096 characters"):
        limits.check_stop(["a" * (limits.MAX_STOP_CHARS + 1)])


def _run(stream: TextStream, chunks: list[bytes]) -> str:
    return "".join([stream.push(c) for c in chunks] + [stream.finish()])


def test_stop_strings_match_across_tokens_by_their_borders():
    # "aab" inside "aaab": a naive restart after the mismatch would miss it
    assert _run(TextStream(["aab"]), [b"a", b"a", b"a", b"b", b"!"]) == "a"
    assert _run(TextStream(["abab"]), [b"aba", b"bab"]) == ""  # the stop begins at the first 'a'
    assert _run(TextStream(["abcdef", "cd"]), [b"a", b"b", b"c", b"d", b"e"]) == "ab"
    assert _run(TextStream(["xyz"]), [b"xy", b"q"]) == "xyq"  # held back, then released


def test_the_longest_stop_strings_cost_each_token_little():
    stream = TextStream(["a" * (limits.MAX_STOP_CHARS - 1) + "b"] * limits.MAX_STOP_STRINGS)
    start = time.perf_counter()
    for _ in range(2000):
        stream.push(b"aaaa")
    per_token = (time.perf_counter() - start) / 2000
    assert not stream.stopped and len(stream.text) == 8000 - (limits.MAX_STOP_CHARS - 1)
    assert per_token < 0.002, f"{per_token * 1e6:.0f} us a token"  # ~100 us here; a naive check took ~10 ms


def _info(tokenize, limit=None) -> LLMInfo:
    return LLMInfo(context_length=100, prompt_byte_limit=limit, tokenize=tokenize)


def test_short_prompts_tokenize_on_the_loop_and_long_ones_on_a_thread():
    seen: list[str] = []

    def tokenize(text: str) -> list[int]:
        seen.append(threading.current_thread().name)
        return [len(text)]

    async def main():
        assert await tokenizing.tokenize(_info(tokenize), "short") == [5]
        long = "x" * (tokenizing.INLINE_CHARS + 1)
        assert await tokenizing.tokenize(_info(tokenize), long) == [len(long)]

    asyncio.run(main())
    assert seen[0] == threading.main_thread().name and seen[1] == "naiad-tokenize"


def test_a_prompt_over_the_bound_never_reaches_the_tokenizer():
    def tokenize(text: str) -> list[int]:
        raise AssertionError("tokenized")

    with pytest.raises(limits.PromptTooLong):
        asyncio.run(tokenizing.tokenize(_info(tokenize, limit=1000), "x" * 1001))


def test_a_slow_tokenization_is_answered_at_its_deadline_and_the_loop_keeps_turning(monkeypatch):
    monkeypatch.setattr(tokenizing.settings, "timeout_s", 0.3)
    release = threading.Event()

    def slow(text: str) -> list[int]:
        release.wait(10)  # a tokenizer stuck in C, the GIL released
        return [1]

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        start = time.monotonic()
        with pytest.raises(tokenizing.TokenizeTimeout, match="did not finish within 0.3s"):
            await tokenizing.tokenize(_info(slow), "x" * 100_000)
        took = time.monotonic() - start
        ticker.cancel()
        return took, ticks

    took, ticks = asyncio.run(main())
    release.set()
    assert 0.25 < took < 2.0
    assert ticks >= 10  # the loop went on meanwhile


def test_abandoned_tokenizations_hold_their_threads_so_they_never_pile_up(monkeypatch):
    monkeypatch.setattr(tokenizing.settings, "timeout_s", 0.2)
    release = threading.Event()
    started: list[int] = []

    def slow(text: str) -> list[int]:
        started.append(1)
        release.wait(10)
        return [1]

    async def main():
        results = await asyncio.gather(
            *(tokenizing.tokenize(_info(slow), "x" * 100_000) for _ in range(tokenizing.THREADS + 2)),
            return_exceptions=True,
        )
        return results

    results = asyncio.run(main())
    release.set()
    assert len(started) == tokenizing.THREADS  # the others never started a thread
    assert sum(isinstance(r, tokenizing.TokenizeTimeout) for r in results) == tokenizing.THREADS
    assert sum(isinstance(r, Unavailable) for r in results) == 2


_BLOCKED_LOOP = textwrap.dedent(
    """
    import asyncio, sys, time
    from naiad.stop_signals import StopSignals

    async def main():
        stop = asyncio.Event()
        StopSignals(asyncio.get_running_loop(), stop.set, float(sys.argv[1])).install()
        print("ready", flush=True)
        if sys.argv[2] == "blocked":
            time.sleep(60)  # the loop never turns: a request holding it
        await stop.wait()
        print("drained", flush=True)
        return 0

    sys.exit(asyncio.run(main()))
    """
)


def _start(exit_timeout: float, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "server"))
    proc = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED_LOOP, str(exit_timeout), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_sigterm_ends_a_process_whose_loop_is_blocked_at_the_exit_timeout():
    proc = _start(1.5, "blocked")
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - start
    assert proc.returncode == 1, (out, err)
    assert 1.3 < took < 5, took  # (the deadline leads the timeout by a tenth of it, at most 0.5 s)
    assert "--exit-timeout-secs (1.5s) after SIGTERM" in err


def test_sigterm_stops_a_free_loop_at_once_and_it_exits_cleanly():
    proc = _start(30, "free")
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "drained" in out, (out, err)
    assert time.monotonic() - start < 5
