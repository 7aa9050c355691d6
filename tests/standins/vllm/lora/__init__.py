"""Stand-in of vllm.lora."""
