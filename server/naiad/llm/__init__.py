"""Large language models: the tensor shape LLM models speak and what the OpenAI frontend needs from them.

An LLM engine is a decoupled backend (llama.cpp, vLLM, transformers) whose model speaks the *vLLM shape* that
Triton's vLLM backend defines (`shape.VLLM_INPUTS` / `shape.VLLM_OUTPUTS`); the OpenAI frontend turns requests into
that shape, or into the TensorRT-LLM shape for repositories written for it. A backend that knows its tokenizer
publishes an `info.LLMInfo` for the version (chat template, special tokens, context length).
"""
