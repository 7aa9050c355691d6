"""Tool-call and reasoning parsers (llm/tool_parsers.py, llm/reasoning.py): each model family's way of writing a
call, streamed and whole, and `<think>` blocks split from the content however the deltas cut the tags."""

from __future__ import annotations

import json

import pytest

from naiad.llm import reasoning, tool_parsers

TOOLS = ["get_weather", "get_time"]


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize(
    "parser, text, content",
    [
        (
            "hermes",
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Let me check.",
        ),
        ("json", '{"name": "get_weather", "arguments": {"city": "Paris"}}', ""),
        ("json", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', ""),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),
        ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Sure."),
    ],
)
def test_each_family_s_calls_are_read(parser, text, content):
    parsed = tool_parsers.parse(parser, text, TOOLS)
    assert parsed is not None and parsed.content == content
    assert _calls(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.calls[0].as_openai()["type"] == "function"


def test_several_calls_and_separators_inside_arguments():
    text = '{"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}'
    assert _calls(tool_parsers.parse("llama3_json", text, TOOLS)) == [
        ("get_weather", {"city": "a;b"}),
        ("get_time", {}),
    ]
    blocks = "".join(f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>' for n in TOOLS)
    assert [c.name for c in tool_parsers.parse("hermes", blocks, TOOLS).calls] == TOOLS


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "delete_everything", "arguments": {}}',  # not one of the request's tools
        "<tool_call>{not json}</tool_call>",
    ],
)
def test_what_is_no_call_of_the_request_s_tools_is_none(text):
    assert tool_parsers.parse("hermes", text, TOOLS) is None
    assert tool_parsers.parse("json", text, TOOLS) is None


def test_the_parser_is_guessed_from_the_chat_template():
    assert tool_parsers.guess("{% if tools %}<tool_call>\n{{ tool }}</tool_call>{% endif %}") == "hermes"
    assert tool_parsers.guess("[AVAILABLE_TOOLS]...[TOOL_CALLS]") == "mistral"
    assert tool_parsers.guess("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert tool_parsers.guess(None) == "json"


def _stream(stream, deltas):
    out = [stream.feed(d) for d in deltas]
    return "".join(out), stream.finish()


def test_a_stream_lets_content_through_and_holds_a_call_cut_anywhere():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    text = "Let me check. " + call
    for cut in range(1, len(text)):
        sent, parsed = _stream(tool_parsers.ToolCallStream("hermes", TOOLS), [text[:cut], text[cut:]])
        assert sent == "Let me check. " and _calls(parsed) == [("get_weather", {"city": "Paris"})], cut


def test_a_stream_of_plain_text_is_all_content_and_a_json_call_is_held_from_its_first_brace():
    sent, parsed = _stream(tool_parsers.ToolCallStream("json", TOOLS), [" ", "Hello", " there"])
    assert sent + parsed.content == " Hello there" and not parsed.calls
    sent, parsed = _stream(
        tool_parsers.ToolCallStream("json", TOOLS), [" ", '{"na', 'me": "get_time", "arguments": {}}']
    )
    assert sent == "" and _calls(parsed) == [("get_time", {})]
    sent, parsed = _stream(tool_parsers.ToolCallStream("json", TOOLS), ['{"not": "a call"}'])
    assert sent == "" and parsed.content == '{"not": "a call"}' and not parsed.calls


def test_reasoning_is_split_from_the_content():
    assert reasoning.split("qwen3", "<think>\nhmm, 2+2\n</think>\n\nIt is 4.") == ("hmm, 2+2", "It is 4.")
    assert reasoning.split("qwen3", "It is 4.") == (None, "It is 4.")
    # the template opened the block: the output starts inside it
    opened = "<|im_start|>assistant\n<think>\n"
    assert reasoning.split("deepseek_r1", "hmm</think>\n\nIt is 4.", prompt=opened) == ("hmm", "It is 4.")


def test_reasoning_streamed_with_tags_cut_across_deltas():
    text = "<think>let me see</think>\n\nfour"
    for cut in range(1, len(text)):
        stream = reasoning.ReasoningStream("think")
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        assert "".join(p[0] for p in parts) == "let me see", cut
        assert "".join(p[1] for p in parts) == "four", cut
