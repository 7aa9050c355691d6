"""Route first, unload after: a copy leaving a pod that stays first loses the pod's routing label, and is unloaded
only once its model's Service endpoints no longer list the pod (or a deadline passed), so kube-proxy never sends
a request to a pod that no longer has the model. Passes never wait: a pending unload is recorded here with its
deadline and finished by a later pass (the pass runner schedules one while any is pending)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

DEFAULT_UNLOAD_DELAY_SECONDS = 5.0
# After the endpoints dropped a pod: time for kube-proxy on every node (and watching clients) to see it too
# (kube-proxy applies EndpointSlice changes at most once a second by default: --iptables-min-sync-period).
DEFAULT_SETTLE_SECONDS = 2.0
# How soon a pass with pending unloads asks for the next one.
RECHECK_SECONDS = 0.5


@dataclass
class PendingUnload:
    deadline: float  # unload then even if the endpoints could not be read or still list the pod
    dropped_at: float | None = None  # when the endpoints were first seen without the pod


class DrainBook:
    """Pending unloads, per (namespace, pool, pod, InferenceModel); kept in memory (after an operator restart the
    label is already gone, so the copy is found unrouted and drained again from the start)."""

    def __init__(
        self,
        delay: float = DEFAULT_UNLOAD_DELAY_SECONDS,
        settle: float = DEFAULT_SETTLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.delay = delay
        self.settle = min(settle, delay)
        self._clock = clock
        self._pending: dict[tuple[str, str, str, str], PendingUnload] = {}

    def draining(self, namespace: str, pool: str) -> dict[str, set[str]]:
        """InferenceModel name -> pods of the pool whose copy is waiting to be unloaded."""
        out: dict[str, set[str]] = {}
        for ns, p, pod, name in self._pending:
            if (ns, p) == (namespace, pool):
                out.setdefault(name, set()).add(pod)
        return out

    def start(self, namespace: str, pool: str, pod: str, name: str) -> bool:
        """Record a copy whose pod just stopped being routed; False when it was already pending."""
        key = (namespace, pool, pod, name)
        if key in self._pending:
            return False
        self._pending[key] = PendingUnload(self._clock() + self.delay)
        return True

    def pending(self, namespace: str, pool: str, pod: str, name: str) -> bool:
        """Whether the copy is already routed away and waiting to be unloaded."""
        return (namespace, pool, pod, name) in self._pending

    def unload_now(self, namespace: str, pool: str, pod: str, name: str, listed: bool | None) -> bool:
        """Whether a pending copy may be unloaded: the endpoints (`listed`: whether they still list the pod; None:
        they could not be read) dropped the pod `settle` seconds ago, or the deadline passed."""
        entry = self._pending.get((namespace, pool, pod, name))
        if entry is None:
            return False
        now = self._clock()
        if listed is False and entry.dropped_at is None:
            entry.dropped_at = now
        elif listed:
            entry.dropped_at = None  # listed again (the label came back meanwhile): wait for it to drop
        if now >= entry.deadline:
            return True
        return entry.dropped_at is not None and now - entry.dropped_at >= self.settle

    def finish(self, namespace: str, pool: str, pod: str, name: str) -> None:
        self._pending.pop((namespace, pool, pod, name), None)

    def retain(self, namespace: str, pool: str, keep: Collection[tuple[str, str]]) -> None:
        """Forget the pool's pending copies not in `keep` ((pod, name) pairs): kept after all, or their pod is gone."""
        for key in [k for k in self._pending if k[:2] == (namespace, pool) and (k[2], k[3]) not in keep]:
            del self._pending[key]

    def recheck_in(self, namespace: str, pool: str) -> float | None:
        """Seconds until the pool's next pass should look at its pending copies (None: nothing pending)."""
        deadlines = [e.deadline for k, e in self._pending.items() if k[:2] == (namespace, pool)]
        if not deadlines:
            return None
        return max(0.0, min(RECHECK_SECONDS, min(deadlines) - self._clock()))
