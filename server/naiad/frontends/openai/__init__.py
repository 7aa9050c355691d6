"""The OpenAI-compatible API (`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/models`): a protocol
adapter that turns OpenAI requests into inference requests for models in the vLLM or TensorRT-LLM shape."""
