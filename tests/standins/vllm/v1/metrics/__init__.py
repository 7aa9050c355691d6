"""Stand-in of vllm.v1.metrics."""
