"""Value types for tritonserver-style command-line flags, shared by `naiad serve` and the flag groups
frontends add to it (TLS)."""

from __future__ import annotations

import argparse


def parse_bool(value: str) -> bool:
    """tritonserver's booleans: true/false, 1/0, yes/no, on/off (any case)."""
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{value}'")
