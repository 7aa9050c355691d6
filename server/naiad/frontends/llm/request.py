"""One LLM request as every API's frontend reads it: a `Generation` (a chat or a completion, its sampling and its
tools) or an `Embedding`; OpenAI's, the Responses API's and Anthropic's request bodies all become these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Generation:
    """One chat or completion request, validated."""

    model: str
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices: n generations of the same prompt (choices.py)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    logprobs: int | None = None  # top logprobs per token asked for (0: only the chosen token's); None: none
    echo: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # vLLM's sampling extensions (VLLM_EXTRA_SAMPLING)
    response_format: dict | None = None  # {"type": "json_schema"|"json_object", ...}
    json_schema: Any = None  # the schema structured output must follow (from response_format or a tool)
    # vLLM's own fields: `structured_outputs` ({"json"|"regex"|"choice"|"grammar"|"json_object": ...}) or the older
    # guided_json / guided_regex / guided_choice / guided_grammar, as one StructuredOutputsParams-shaped dict
    structured_outputs: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    messages: list[dict] | None = None  # chat
    prompt: str | None = None  # completions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    # the images the messages' image parts (media.py) point to, read by the generation service before rendering
    images: list[bytes] = field(default_factory=list)


@dataclass
class Embedding:
    model: str
    inputs: list[Any]  # strings or lists of token ids, one embedding each
    encoding_format: str = "float"
    dimensions: int | None = None
