"""Stand-in for cuda-python's `cuda` package (tests only; see tests/standins/README.md)."""
