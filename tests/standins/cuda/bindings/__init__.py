"""Stand-in for `cuda.bindings` (tests only)."""
