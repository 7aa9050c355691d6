"""The OpenAI-compatible API (/v1 chat, completions, embeddings, models) for vLLM- or TRT-LLM-shaped models."""
