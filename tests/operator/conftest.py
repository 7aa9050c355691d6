"""Make the operator package importable from a plain checkout (no install needed for these unit tests), and the
e2e harness (the `e2e` package at the repository root) for tests/operator/test_operator_cluster.py."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "operator") not in sys.path:
    sys.path.insert(0, str(ROOT / "operator"))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
