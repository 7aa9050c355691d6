"""`naiad analyze`: find the model configuration with the most throughput within a p99 latency budget."""
