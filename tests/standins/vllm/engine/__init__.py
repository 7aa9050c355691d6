"""Stand-in of vllm.engine."""
