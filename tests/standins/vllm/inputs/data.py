"""Stand-in of vllm.inputs.data: a prompt given as token ids."""

from typing import TypedDict


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
