"""The error an LLM request meets in the frontends, before or while it reaches its model: a status and the request
field it is about (`param`) and a code (`context_length_exceeded`, `model_not_found`), which each API answers in its
own error object (OpenAI's, Anthropic's)."""

from __future__ import annotations


class LLMError(Exception):
    """An LLM request's error; `status` is the HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
