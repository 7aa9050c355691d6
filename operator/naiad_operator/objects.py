"""Type aliases for Kubernetes objects as the operator reads and writes them (plain JSON-shaped dicts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Body = dict[str, Any]  # an object the operator builds or patches
Spec = Mapping[str, Any]  # a spec (or any part of an object) the operator only reads
