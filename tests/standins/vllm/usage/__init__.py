"""Stand-in of vllm.usage."""
