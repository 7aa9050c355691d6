"""Model orchestration: loading on demand, measured model memory, the memory budget, eviction and idle unload."""
