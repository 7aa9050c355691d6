"""Remembers what the operator last applied (and found absent), so a resync does not re-send unchanged children:
an object is applied again only when its rendering changed, when a watch saw it deleted, or after
`refresh_seconds` (a slow safety net against drift no watch reports, e.g. an edit by hand)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

Key = tuple[str, str, str, str]  # (apiVersion, kind, namespace, name)
ABSENT = "absent"


def key_of(body: Mapping[str, Any]) -> Key:
    meta = body["metadata"]
    return body["apiVersion"], body["kind"], meta.get("namespace") or "", meta["name"]


def digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class AppliedCache:
    def __init__(self, refresh_seconds: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._seen: dict[Key, tuple[str, float]] = {}

    def _fresh(self, key: Key, value: str) -> bool:
        seen = self._seen.get(key)
        return seen is not None and seen[0] == value and self._clock() - seen[1] < self.refresh_seconds

    def unchanged(self, body: Mapping[str, Any]) -> bool:
        """True when exactly this body was applied recently: no need to send it again."""
        return self._fresh(key_of(body), digest(body))

    def applied(self, body: Mapping[str, Any]) -> None:
        self._seen[key_of(body)] = (digest(body), self._clock())

    def known_absent(self, key: Key) -> bool:
        return self._fresh(key, ABSENT)

    def absent(self, key: Key) -> None:
        self._seen[key] = (ABSENT, self._clock())

    def forget(self, key: Key) -> None:
        """The object changed under us (deleted, or edited by someone else): apply it again next time."""
        self._seen.pop(key, None)
