"""Make the operator package importable from a plain checkout (no install needed for these unit tests)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT / "operator",):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
