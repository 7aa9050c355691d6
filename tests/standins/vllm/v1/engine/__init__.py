"""Stand-in of vllm.v1.engine."""
