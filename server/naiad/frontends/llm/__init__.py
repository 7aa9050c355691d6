"""What the LLM APIs share (OpenAI's, the Responses API, Anthropic's Messages): the request as one `Generation`, chat
templates, the generation service that bounds, tokenizes and runs a request on its model, and the shaping of its text
into content, reasoning and tool calls."""
