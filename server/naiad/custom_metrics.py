"""Custom metrics (counters, gauges, histograms with labels) that python models and backends add to `/metrics`.

Models reach this registry through `pb_utils.MetricFamily` (in-process directly, from worker processes through
their side channel); families and metrics are addressed by integer ids so that both paths are the same calls.
A family is shared by every model that creates it with the same name and kind, and a metric by every caller
that asks for the same labels (as Triton's custom metrics API does). Each family and metric records its
owners, the model instances that asked for it; when an instance is unloaded it `release`s them, and what no
owner holds any more leaves /metrics (Triton deletes them with the model's Python objects). A restarted python
worker is the same owner, so it carries on counting where the dead one stopped. Owner None holds for the
server's lifetime.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import re
import threading

from .errors import AlreadyExists, InvalidArgument

COUNTER, GAUGE, HISTOGRAM = 0, 1, 2  # the values of pb_utils.MetricFamily.COUNTER / GAUGE / HISTOGRAM
KIND_NAMES = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class _Family:
    __slots__ = ("description", "kind", "metrics", "name", "owners")

    def __init__(self, name: str, description: str, kind: int):
        self.name = name
        self.description = description
        self.kind = kind
        self.metrics: dict[tuple, int] = {}  # sorted label items -> metric id
        self.owners: set = set()


class _Metric:
    __slots__ = ("bounds", "counts", "family", "key", "labels", "owners", "sum", "value")

    def __init__(self, family: _Family, key: tuple, labels: dict[str, str], bounds: list[float] | None):
        self.family = family
        self.key = key
        self.labels = labels
        self.owners: set = set()
        self.value = 0.0
        self.bounds = bounds  # histograms: the upper bounds, ascending, without +Inf
        self.counts = [0] * (len(bounds) + 1) if bounds is not None else None
        self.sum = 0.0


class CustomMetrics:
    """Thread-safe store of custom metric families; `exposition()` renders them in Prometheus text format."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._families: dict[int, _Family] = {}
        self._by_name: dict[str, int] = {}
        self._metrics: dict[int, _Metric] = {}

    # ---- families and metrics ----
    def family(self, name: str, description: str, kind: int, owner=None) -> int:
        """The id of family `name`, created on first use; the same name with another kind is an error."""
        if kind not in KIND_NAMES:
            raise InvalidArgument(f"unknown metric kind {kind!r}: expected COUNTER, GAUGE or HISTOGRAM")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgument(
                f"Error when creating MetricFamily: Invalid metric name {name!r} (it must match {_NAME.pattern})"
            )
        if not isinstance(description, str):
            raise InvalidArgument(f"metric family '{name}': description must be a string")
        with self._lock:
            fid = self._by_name.get(name)
            if fid is not None:
                existing = self._families[fid]
                if existing.kind != kind:
                    raise AlreadyExists(
                        "Error when creating MetricFamily: Family name already exists with different type"
                    )
                existing.owners.add(owner)
                return fid
            family = _Family(name, description, kind)
            family.owners.add(owner)
            fid = self._by_name[name] = next(self._ids)
            self._families[fid] = family
            return fid

    def metric(self, family_id: int, labels: dict | None, buckets: list | None = None, owner=None) -> int:
        """The id of the metric of `family_id` with these labels (shared with every caller asking for them)."""
        family = self._family(family_id)
        labels = dict(labels or {})
        for key, value in labels.items():
            if not isinstance(key, str) or not _LABEL.match(key) or key == "le":
                raise InvalidArgument(f"metric family '{family.name}': invalid label name {key!r}")
            if not isinstance(value, str):
                raise InvalidArgument(
                    f"metric family '{family.name}': label '{key}' must have a string value, "
                    f"got {type(value).__name__}"
                )
        bounds = None
        if family.kind == HISTOGRAM:
            if buckets is None:
                raise InvalidArgument("Failed to create metric. Missing required buckets.")
            try:
                bounds = sorted(float(b) for b in buckets)
            except (TypeError, ValueError):
                raise InvalidArgument("Failed to create metric. Buckets must be a list of numbers.") from None
            bounds = [b for b in bounds if not math.isinf(b)]
        elif buckets is not None:
            raise InvalidArgument("Failed to create metric. Unexpected buckets found.")
        key = tuple(sorted(labels.items()))
        with self._lock:
            if self._families.get(family_id) is not family:
                raise InvalidArgument(f"metric family '{family.name}' has been deleted")
            mid = family.metrics.get(key)
            if mid is not None:
                if bounds is not None and self._metrics[mid].bounds != bounds:
                    raise AlreadyExists(
                        f"metric family '{family.name}' already has a histogram with labels "
                        f"{json.dumps(labels)} and other buckets"
                    )
                self._metrics[mid].owners.add(owner)
                return mid
            metric = _Metric(family, key, labels, bounds)
            metric.owners.add(owner)
            mid = family.metrics[key] = next(self._ids)
            self._metrics[mid] = metric
            return mid

    def release(self, owner) -> None:
        """`owner` (an unloaded model instance) no longer holds anything: drop what nobody else holds."""
        if owner is None:
            return
        with self._lock:
            for mid, metric in list(self._metrics.items()):
                if owner in metric.owners:
                    metric.owners.discard(owner)
                    if not metric.owners:
                        del self._metrics[mid]
                        del metric.family.metrics[metric.key]
            for fid, family in list(self._families.items()):
                family.owners.discard(owner)
                if not family.owners and not family.metrics:
                    del self._families[fid]
                    del self._by_name[family.name]

    # ---- values ----
    def update(self, metric_id: int, op: str, value: float) -> None:
        """`increment`, `set` or `observe`, as the kind of the metric allows."""
        metric = self._metric(metric_id)
        value = check_update(metric.family.kind, op, value)
        with self._lock:
            if op == "increment":
                metric.value += value
            elif op == "set":
                metric.value = value
            else:
                metric.counts[bisect.bisect_left(metric.bounds, value)] += 1
                metric.sum += value

    def value(self, metric_id: int) -> float:
        metric = self._metric(metric_id)
        if metric.family.kind == HISTOGRAM:
            raise InvalidArgument(
                "Failed to get metric value: TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Value"
            )
        with self._lock:
            return metric.value

    def _family(self, family_id) -> _Family:
        family = self._families.get(family_id) if isinstance(family_id, int) else None
        if family is None:
            raise InvalidArgument(
                "Invalid metric operation as the corresponding 'MetricFamily' has been deleted "
                "(the model that created it was unloaded)"
            )
        return family

    def _metric(self, metric_id) -> _Metric:
        metric = self._metrics.get(metric_id) if isinstance(metric_id, int) else None
        if metric is None:
            raise InvalidArgument(
                "Invalid metric operation as the corresponding 'Metric' has been deleted "
                "(the model that created it was unloaded)"
            )
        return metric

    # ---- exposition ----
    def exposition(self) -> bytes:
        """Prometheus text format; a family without metrics is left out (as prometheus-cpp does)."""
        lines: list[str] = []
        with self._lock:
            for family in self._families.values():
                if not family.metrics:
                    continue
                lines.append(f"# HELP {family.name} {_escape_help(family.description)}")
                lines.append(f"# TYPE {family.name} {KIND_NAMES[family.kind]}")
                for mid in family.metrics.values():
                    metric = self._metrics[mid]
                    if family.kind != HISTOGRAM:
                        lines.append(f"{family.name}{_labels(metric.labels)} {_number(metric.value)}")
                        continue
                    lines.append(f"{family.name}_count{_labels(metric.labels)} {sum(metric.counts)}")
                    lines.append(f"{family.name}_sum{_labels(metric.labels)} {_number(metric.sum)}")
                    running = 0
                    for bound, count in zip((*metric.bounds, math.inf), metric.counts):
                        running += count
                        le = "+Inf" if math.isinf(bound) else _number(bound)
                        lines.append(f"{family.name}_bucket{_labels({**metric.labels, 'le': le})} {running}")
        return ("\n".join(lines) + "\n").encode() if lines else b""


def check_update(kind: int, op: str, value) -> float:
    """The value as a float when `op` (increment, set, observe) suits a metric of `kind`; else InvalidArgument
    with Triton's message."""
    if isinstance(value, bool):
        value = int(value)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"metric value must be a number, got {type(value).__name__}") from None
    allowed = {"increment": (COUNTER, GAUGE), "set": (GAUGE,), "observe": (HISTOGRAM,)}
    if op not in allowed:
        raise InvalidArgument(f"unknown metric operation '{op}'")
    prefix = f"Failed to {op} metric value: TRITONSERVER_METRIC_KIND_{KIND_NAMES[kind].upper()}"
    if kind not in allowed[op]:
        raise InvalidArgument(f"{prefix} does not support {op.capitalize()}")
    if op == "increment" and kind == COUNTER and value < 0:
        raise InvalidArgument(f"{prefix} can only be incremented monotonically by non-negative values")
    return value


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(
        '{}="{}"'.format(k, v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"'))
        for k, v in labels.items()
    )
    return "{" + inner + "}"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)
