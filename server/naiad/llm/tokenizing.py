"""Prompts tokenized (and chat templates rendered) off the event loop, within a deadline.

The loop serves every model and protocol, health and metrics too: a tokenizer call that takes seconds on it stops
all of them, SIGTERM's handler included. So work on a large text runs on a thread of its own (llama.cpp's and Hugging
Face's tokenizers release the GIL), at most `THREADS` at once, and a request whose work passes its deadline is
answered at once while the thread finishes on its own (it cannot be interrupted; it still holds its place, so
abandoned work never piles up past `THREADS`). Short texts, the common case, stay on the loop: a thread hop costs
more than tokenizing them. Every text is bounded in bytes first (limits.check_prompt).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import InvalidArgument, Unavailable
from . import limits
from .info import LLMInfo

T = TypeVar("T")

#: texts up to this many characters are tokenized on the loop (llama.cpp's BPE: ~0.1 ms a kilobyte)
INLINE_CHARS = 2048
#: threads tokenizing or rendering at once, in this process
THREADS = 2
DEFAULT_TIMEOUT_S = 10.0


class TokenizeTimeout(InvalidArgument):
    """The text's tokenization (or rendering) took longer than the deadline: the request is answered, the work
    abandoned."""


class _Settings:
    timeout_s = DEFAULT_TIMEOUT_S


settings = _Settings()
_slots: asyncio.Semaphore | None = None
_slots_loop: asyncio.AbstractEventLoop | None = None


def configure(timeout_s: float) -> None:
    """The deadline of one tokenization (`--llm-tokenize-timeout-secs`)."""
    if timeout_s <= 0:
        raise ValueError("--llm-tokenize-timeout-secs must be positive")
    settings.timeout_s = timeout_s


def _semaphore() -> asyncio.Semaphore:
    global _slots, _slots_loop
    loop = asyncio.get_running_loop()
    if _slots is None or _slots_loop is not loop:
        _slots, _slots_loop = asyncio.Semaphore(THREADS), loop
    return _slots


async def off_loop(fn: Callable[..., T], *args: Any, size: int, what: str = "tokenizing the prompt") -> T:
    """`fn(*args)`: on the loop when `size` (characters) is small, else on a daemon thread within the deadline.
    A coroutine function is awaited within the deadline (a tokenizer in another process)."""
    timeout = settings.timeout_s
    if inspect.iscoroutinefunction(fn):
        try:
            return await asyncio.wait_for(fn(*args), timeout)
        except TimeoutError:
            raise TokenizeTimeout(_late(what, timeout)) from None
    if size <= INLINE_CHARS:
        return fn(*args)
    loop = asyncio.get_running_loop()
    slots = _semaphore()
    deadline = loop.time() + timeout
    try:
        await asyncio.wait_for(slots.acquire(), timeout)
    except TimeoutError:
        raise Unavailable(
            f"the server is busy with other large prompts: {what} waited {timeout:g}s for a thread"
        ) from None
    done: asyncio.Future = loop.create_future()

    def finished(ok: bool, value: Any) -> None:
        slots.release()  # when the work is over, not when its request stopped waiting for it
        if not done.done():
            if ok:
                done.set_result(value)
            else:
                done.set_exception(value)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the waiting request
            _call_soon(loop, finished, False, exc)
        else:
            _call_soon(loop, finished, True, result)

    # a daemon thread: an abandoned tokenization never holds up the process's exit
    threading.Thread(target=work, name="naiad-tokenize", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), max(0.0, deadline - loop.time()))
    except TimeoutError:
        raise TokenizeTimeout(_late(what, timeout)) from None


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed meanwhile (the server stopped)
        pass


def _late(what: str, timeout: float) -> str:
    return f"{what} did not finish within {timeout:g}s (--llm-tokenize-timeout-secs): send a shorter prompt"


async def tokenize(info: LLMInfo, text: str, add_special: bool | None = None) -> list[int]:
    """`text`'s token ids by the model's tokenizer: bounded in bytes, off the loop when large, within the deadline;
    `add_special`: with the tokenizer's special tokens (BOS) or without (None: as the engine tokenizes a prompt)."""
    assert info.tokenize is not None
    limits.check_prompt(text, info.prompt_byte_limit, info.context_length)
    args = (text,) if add_special is None else (text, add_special)
    out = await off_loop(info.tokenize, *args, size=len(text))
    return await out if inspect.isawaitable(out) else out


async def detokenize(info: LLMInfo, ids: list[int]) -> str:
    """The text of token ids, off the loop when they are many."""
    assert info.detokenize is not None
    out = await off_loop(info.detokenize, ids, size=len(ids) * 4, what="detokenizing the tokens")
    return await out if inspect.isawaitable(out) else out
