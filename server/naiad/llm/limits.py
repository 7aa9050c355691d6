"""What one LLM request may ask of an engine, checked before the engine does any work for it: the prompt's size in
bytes against what the model's context can hold under any tokenization, and the stop strings.

A tokenizer can be superlinear on hostile input (llama.cpp's took minutes for 500 KB of `"word "`), so a prompt is
measured in bytes first. Every token stands for at most `max_token_bytes` bytes of its text, so a prompt of more
than `context_length * max_token_bytes` bytes has more tokens than the context holds, whatever the tokenizer does
with it: it is refused without being tokenized. A tokenizer that normalizes its input first (NFKC, accents
stripped, as WordPiece and Unigram vocabularies do) may shrink it, so for those the bound is `NORMALIZING_FACTOR`
times larger; a model's `max_prompt_bytes` parameter lowers it further.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..errors import InvalidArgument

#: how much a normalizing tokenizer may shrink its input before splitting it (fullwidth forms to ASCII: 3 bytes to 1)
NORMALIZING_FACTOR = 4
#: stop strings one request may give, and characters each (every generated token is checked against all of them)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096


class PromptTooLong(InvalidArgument):
    """A prompt refused by its size alone: more bytes than the model's context holds under any tokenization."""

    def __init__(self, n_bytes: int, limit: int, context_length: int | None):
        context = (
            f"This model's maximum context length is {context_length} tokens. " if context_length else ""
        )
        super().__init__(
            f"{context}However, your prompt has {n_bytes} bytes, more than the {limit} bytes it can hold. "
            "Please reduce the length of the prompt."
        )
        self.n_bytes = n_bytes
        self.limit = limit


def prompt_byte_limit(
    context_length: int | None,
    max_token_bytes: int | None,
    max_prompt_bytes: int | None = None,
    normalizing: bool = False,
) -> int | None:
    """The most bytes of prompt that can fit the context (None: no bound known)."""
    bound = None
    if context_length and max_token_bytes:
        bound = context_length * max_token_bytes * (NORMALIZING_FACTOR if normalizing else 1)
    if max_prompt_bytes is not None:
        bound = max_prompt_bytes if bound is None else min(bound, max_prompt_bytes)
    return bound


def max_prompt_bytes_parameter(parameters: Mapping[str, str]) -> int | None:
    """The `max_prompt_bytes` model parameter (config.pbtxt), or None; a malformed one fails the load."""
    raw = parameters.get("max_prompt_bytes")
    if raw is None or str(raw).strip() == "":
        return None
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = 0
    if value <= 0:
        raise InvalidArgument(f"parameter 'max_prompt_bytes' must be a positive integer, got {raw!r}")
    return value


def check_bytes(n_bytes: int, limit: int | None, context_length: int | None = None) -> None:
    """PromptTooLong when a prompt of `n_bytes` (or at least that many) is over `limit` bytes."""
    if limit is not None and n_bytes > limit:
        raise PromptTooLong(n_bytes, limit, context_length)


def check_prompt(text: str | bytes, limit: int | None, context_length: int | None = None) -> None:
    """PromptTooLong when `text` is over `limit` bytes; costs no encoding when its length alone decides."""
    if limit is None:
        return
    n = len(text)
    if isinstance(text, str):
        check_bytes(n, limit, context_length)  # a character is at least one byte
        if 4 * n <= limit:  # and at most four
            return
        n = len(text.encode("utf-8", "surrogatepass"))
    check_bytes(n, limit, context_length)


def max_token_bytes(pieces: Iterable[str | bytes]) -> int:
    """The longest token's text in bytes, from every token's text (a vocabulary's strings or pieces)."""
    sizes = (len(p.encode("utf-8", "surrogatepass")) if isinstance(p, str) else len(p) for p in pieces)
    return max(sizes, default=0)


def check_stop(stop: list[str], where: str = "stop") -> list[str]:
    """`stop` within MAX_STOP_STRINGS strings of MAX_STOP_CHARS characters each (InvalidArgument naming `where`)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"'{where}' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for s in stop:
        if len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(
                f"each of '{where}' may be at most {MAX_STOP_CHARS} characters long, got one of {len(s)}"
            )
    return stop


def tokenizer_byte_limit(
    tokenizer: object, context_length: int | None, max_prompt_bytes: int | None
) -> int | None:
    """The bound for a Hugging Face tokenizer (transformers, vLLM): its vocabulary's longest token, times
    NORMALIZING_FACTOR unless it splits the text as it is (a fast tokenizer without a normalizer: byte-level BPE)."""
    try:
        vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    except Exception:  # a tokenizer without a vocabulary to list: only the configured bound
        return prompt_byte_limit(None, None, max_prompt_bytes)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizing = backend is None or getattr(backend, "normalizer", None) is not None
    return prompt_byte_limit(context_length, max_token_bytes(vocab), max_prompt_bytes, normalizing)
