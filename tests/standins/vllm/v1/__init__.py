"""Stand-in of vllm.v1."""
