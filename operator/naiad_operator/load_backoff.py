"""Failed loads per (pod, model, revision), so a broken model waits out a growing back-off instead of reloading
every pass."""

from __future__ import annotations

import time
from typing import Any


class LoadBackoff:
    """Remembers failed loads per (pod, model, revision) so a broken model is not reloaded every pass; the wait
    doubles with each failure up to 16 times the base. Kept in memory: an operator restart simply retries."""

    def __init__(self, base_seconds: float, clock: Any = time.monotonic):
        self._base = base_seconds
        self._clock = clock
        self._failures: dict[tuple[str, str, str, str], tuple[int, float, str]] = {}

    def failed(self, namespace: str, pod: str, model: str, revision: str, message: str) -> None:
        # Forget failures whose back-off ended long ago (old revisions, pods that are gone).
        stale = self._clock() - 3600
        for old in [k for k, (_, until, _) in self._failures.items() if until < stale]:
            del self._failures[old]
        key = (namespace, pod, model, revision)
        count = self._failures.get(key, (0, 0.0, ""))[0] + 1
        delay = self._base * min(2 ** (count - 1), 16)
        self._failures[key] = (count, self._clock() + delay, message)

    def succeeded(self, namespace: str, pod: str, model: str, revision: str) -> None:
        self._failures.pop((namespace, pod, model, revision), None)

    def avoid(self, namespace: str, model: str, revision: str) -> dict[str, str]:
        """Pods still waiting out a failure of this revision, with the failure message."""
        now = self._clock()
        return {
            pod: msg
            for (ns, pod, m, rev), (_, until, msg) in self._failures.items()
            if ns == namespace and m == model and rev == revision and until > now
        }

    def forget_model(self, namespace: str, model: str) -> None:
        for key in [k for k in self._failures if k[0] == namespace and k[2] == model]:
            del self._failures[key]
