"""`minReplicas: 0` on a shared pool: a model with no request for `idleSeconds` gives up every copy; its Service then
selects every pod of the pool that runs with `--load-on-demand`, so the next request loads it there, and a copy
loaded that way brings the model back to its replicas (the operator adopts it and places the rest)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .objects import Spec
from .pool_wake import pool_scales_to_zero

LOAD_ON_DEMAND_FLAG = "--load-on-demand"
DEFAULT_IDLE_SECONDS = 300
SCALED_TO_ZERO_CONDITION = "ScaledToZero"

_FALSE = ("false", "0", "no", "off")


def runs_on_demand(args: Iterable[Any]) -> bool:
    """Whether `naiad serve` arguments turn on --load-on-demand (the last occurrence wins)."""
    on = False
    for arg in args:
        name, sep, value = str(arg).partition("=")
        if name == LOAD_ON_DEMAND_FLAG:
            on = not (sep and value.strip().lower() in _FALSE)
    return on


def with_load_on_demand(spec: Spec, models: Iterable[Mapping[str, Any]]) -> Spec:
    """The pool spec its Deployment is rendered from: `--load-on-demand` added to the server's args when one of
    the pool's InferenceModels may scale to zero, or the pool itself (a request that wakes it arrives before the
    operator has placed anything; the user's args may still say otherwise)."""
    if not pool_scales_to_zero(spec) and not any(_may_scale_to_zero(m.get("spec") or {}) for m in models):
        return spec
    args = list(spec.get("args") or [])
    if any(str(a).partition("=")[0] == LOAD_ON_DEMAND_FLAG for a in args):
        return spec  # the user's own setting stands (off: the models of this pool stay placed)
    return {**spec, "args": [*args, LOAD_ON_DEMAND_FLAG]}


def _may_scale_to_zero(spec: Spec) -> bool:
    return spec.get("minReplicas") == 0 and bool(spec.get("serverRef")) and not spec.get("suspended")


def scaled_in_status(status: Mapping[str, Any] | None) -> bool:
    """The ScaledToZero condition a model's status carries (what an operator that restarted goes on from)."""
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == SCALED_TO_ZERO_CONDITION:
            return cond.get("status") == "True"
    return False


def model_requests(
    counters: Mapping[str, Mapping[str, tuple[float, float]]], ips: Sequence[str], model_name: str
) -> float | None:
    """Requests (successful and failed) the pods at `ips` report for a model; None when one of them could not be
    read (then nobody can say the model is idle)."""
    total = 0.0
    for ip in ips:
        reading = counters.get(ip)
        if reading is None:
            return None
        ok, failed = reading.get(model_name, (0.0, 0.0))
        total += ok + failed
    return total


@dataclass
class _Activity:
    requests: float | None  # what the holders reported at the previous reading
    since: float  # when that count last changed, or the clock (re)started
    scaled: bool


class IdleClock:
    """Per model: when its request count last moved, and whether it is scaled to zero (kept in memory; after a
    restart the status's ScaledToZero condition says which models are, and every idle clock starts again)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._models: dict[tuple[str, str], _Activity] = {}

    def scaled(self, namespace: str, name: str, status: Mapping[str, Any] | None) -> bool:
        activity = self._models.get((namespace, name))
        return activity.scaled if activity is not None else scaled_in_status(status)

    def idle_for(self, namespace: str, name: str, requests: float | None) -> float | None:
        """Seconds since the model's request count last changed (None: the count could not be read)."""
        now = self._clock()
        key = (namespace, name)
        activity = self._models.get(key)
        if activity is None:
            self._models[key] = _Activity(requests, now, False)
            return None if requests is None else 0.0
        if requests is None:
            return None
        if activity.requests is None or requests != activity.requests:
            activity.requests, activity.since = requests, now
        return now - activity.since

    def set_scaled(self, namespace: str, name: str, scaled: bool) -> None:
        """Record a change of state; either way the idle clock starts again from now."""
        self._models[(namespace, name)] = _Activity(None, self._clock(), scaled)

    def forget(self, namespace: str, name: str) -> None:
        self._models.pop((namespace, name), None)


@dataclass(frozen=True)
class ZeroDecision:
    """What a pass does with a model that may scale to zero."""

    scaled: bool  # no copies are kept: the model's Service selects the pool's on-demand pods
    woke: bool = False  # a copy loaded on demand brought it back in this pass
    went: bool = False  # it gives up its copies in this pass


def decide(
    *,
    scaled_before: bool,
    holders: int,
    on_demand_pods: int,
    other_pods: int,
    idle_seconds: float,
    idle_for: float | None,
) -> ZeroDecision:
    """`holders`: ready pods holding the model; `on_demand_pods` / `other_pods`: ready pods of the pool that run
    with / without --load-on-demand. A model goes to zero only when every ready pod can load it on demand (a pod
    that cannot would answer 404 while the Service still lists it), and comes back as soon as a pod holds it or
    no pod could load it on demand any more."""
    if scaled_before:
        if holders or on_demand_pods == 0 or other_pods:
            return ZeroDecision(scaled=False, woke=True)
        return ZeroDecision(scaled=True)
    if on_demand_pods and not other_pods and idle_for is not None and idle_for >= idle_seconds:
        return ZeroDecision(scaled=True, went=True)
    return ZeroDecision(scaled=False)
