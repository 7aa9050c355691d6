"""Trace extension (`/v2/trace/setting`, gRPC TraceSetting): which requests are traced, and their TIMESTAMPS.

Both of Triton's trace modes share the settings and the sampling here. Mode `triton` writes each traced request
as a model record and a timestamps record in the trace file, as Triton does: `[{"id": 1, "model_name": "m",
"model_version": 1}, {"id": 1, "timestamps": [{"name": "REQUEST_START", "ns": ...}, ...]}, ...]` (monotonic-clock
nanoseconds, like Triton's steady clock; an ensemble step's record has the ensemble's id as `parent_id`). Mode
`opentelemetry` exports spans instead (otel.py); a request carrying a W3C traceparent is then always traced, as
in Triton.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time

from .errors import InvalidArgument

log = logging.getLogger("naiad.trace")

DEFAULTS = {
    "trace_level": ["OFF"],
    "trace_rate": "1000",
    "trace_count": "-1",
    "log_frequency": "0",
    "trace_file": "",
    "trace_mode": "triton",
}
_LEVELS = {"OFF", "TIMESTAMPS", "TENSORS"}
_MODES = ("triton", "opentelemetry")
# settings the trace extension reports in mode opentelemetry but does not change (Triton ignores them too)
_STARTUP_ONLY = frozenset(
    ("trace_mode", "url", "resource", "bsp_max_export_batch_size", "bsp_schedule_delay", "bsp_max_queue_size")
)
_MAX_KEPT = 100_000


class RequestTrace(list):
    """One traced request's (name, monotonic ns) timestamps; the schedulers append to it. In mode
    `opentelemetry` it also holds the request's open spans."""

    __slots__ = ("id", "offset", "parent_id", "root", "span")

    def __init__(self, trace_id: int):
        super().__init__()
        self.id = trace_id
        self.parent_id = None
        self.offset = 0
        self.root = None
        self.span = None

    def traceparent(self) -> str | None:
        """The W3C traceparent of this request's model span (mode opentelemetry), else None."""
        if self.span is None:
            return None
        c = self.span.get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


class Nested(str):
    """The W3C traceparent of a calling model's span (a BLS call from a python model): the callee's model span
    becomes its child, with no `InferRequest` span of its own."""


class Tracer:
    def __init__(self, settings: dict | None = None):
        self.global_settings = dict(DEFAULTS)
        self.model_settings: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._seen: dict[str, int] = {}
        self._traced: dict[str, int] = {}
        self._entries: dict[str, list] = {}
        self._merged: dict[str, dict] = {}
        self._active = False  # any setting asks for TIMESTAMPS: requests skip the tracer entirely otherwise
        self.otel_settings: dict = {}  # `--trace-config opentelemetry,...` (startup only, as in Triton)
        self._otel = None  # OtelExporter, created when the mode is first `opentelemetry`
        if settings:
            self.update(settings, startup=True)

    # ---- settings ----
    def _validated(self, changes: dict, startup: bool) -> dict:
        out = {}
        for key, value in changes.items():
            if not startup and key in _STARTUP_ONLY:
                continue  # as Triton: the mode and the exporter's settings are fixed at start, updates ignored
            if key not in DEFAULTS:
                raise InvalidArgument(f"unknown trace setting '{key}'")
            if value is None:
                out[key] = None
                continue
            if key == "trace_level":
                levels = value if isinstance(value, list) else [value]
                if not all(isinstance(v, str) and v in _LEVELS for v in levels):
                    raise InvalidArgument(f"trace_level must be a list of {sorted(_LEVELS)}")
                out[key] = levels
            elif key == "trace_mode":
                if value not in _MODES:
                    raise InvalidArgument(f"trace_mode must be one of {', '.join(_MODES)}, got '{value}'")
                out[key] = value
            elif key in ("trace_rate", "trace_count", "log_frequency"):
                try:
                    n = int(value)
                except (TypeError, ValueError):
                    raise InvalidArgument(f"trace setting '{key}' must be an integer") from None
                if key == "trace_rate" and n == 0 and not startup:
                    # Triton's words; `--trace-config rate=0` (only requests with a traceparent) is allowed
                    raise InvalidArgument(
                        "Attempting to set invalid trace setting :sample rate must be non-zero"
                    )
                if n < (-1 if key == "trace_count" else 0):
                    raise InvalidArgument(f"trace setting '{key}' is out of range: {n}")
                out[key] = str(n)
            else:
                out[key] = str(value)
        return out

    def get(self, model: str = "") -> dict:
        """The settings as the trace extension reports them; in mode opentelemetry, Triton's set: no file
        settings, the exporter's instead."""
        settings = dict(self._effective(model))
        if settings["trace_mode"] != "opentelemetry":
            return settings
        from .otel import DEFAULTS as OTEL_DEFAULTS

        otel = {**OTEL_DEFAULTS, **self.otel_settings}
        del settings["trace_file"], settings["log_frequency"]
        settings["url"] = otel["url"]
        if self.otel_settings.get("resource"):
            settings["resource"] = ",".join(f"{k}={v}" for k, v in self.otel_settings["resource"].items())
        for key in ("bsp_max_export_batch_size", "bsp_schedule_delay", "bsp_max_queue_size"):
            settings[key] = str(otel[key])
        return settings

    def _effective(self, model: str) -> dict:
        """A model's settings (its overrides on the global ones), cached until the next update; not a copy."""
        merged = self._merged.get(model)
        if merged is None:
            with self._lock:
                merged = dict(self.global_settings)
                merged.update(self.model_settings.get(model, {}))
                self._merged[model] = merged
        return merged

    def update(self, changes: dict, model: str = "", startup: bool = False) -> dict:
        """Apply settings from the trace extension (or, `startup`, from `--trace-config`)."""
        if not isinstance(changes, dict):
            raise InvalidArgument("trace settings must be a JSON object")
        valid = self._validated(changes, startup)
        with self._lock:
            before = (dict(self.global_settings), {m: dict(v) for m, v in self.model_settings.items()})
            target = self.model_settings.setdefault(model, {}) if model else self.global_settings
            for key, value in valid.items():
                if value is None:  # null clears a model override / restores the default
                    if model:
                        target.pop(key, None)
                    else:
                        target[key] = DEFAULTS[key]
                else:
                    target[key] = value
            self._traced.clear()
            self._merged = {}
            active = any(
                "TIMESTAMPS" in s.get("trace_level", ())
                for s in [self.global_settings, *self.model_settings.values()]
            )
            if active and self.global_settings["trace_mode"] == "opentelemetry" and self._otel is None:
                from .otel import OtelExporter

                try:
                    self._otel = OtelExporter(self.otel_settings)
                except Exception:  # e.g. no SDK installed: the settings stay as they were
                    self.global_settings, self.model_settings = before
                    raise
            self._active = active
        self.flush()
        return self.get(model)

    @property
    def active(self) -> bool:
        """Whether any request may be traced now (frontends look for a traceparent only then)."""
        return self._active

    # ---- tracing ----
    def start(self, mv, request) -> RequestTrace | None:
        """Begin tracing `request` to model version `mv` when it is sampled (or carries a parent context in mode
        opentelemetry), else None. Costs one attribute test when tracing is off."""
        if not self._active:
            return None
        model = mv.name
        s = self._effective(model)
        if "TIMESTAMPS" not in s["trace_level"]:
            return None
        otel = self._otel if self.global_settings["trace_mode"] == "opentelemetry" else None
        parent = request.traceparent
        parent_ctx, nested = None, False
        if isinstance(parent, RequestTrace):  # an ensemble step of a traced ensemble
            if otel is None:
                nested = True
            elif parent.span is not None:
                nested, parent_ctx = True, otel.context_of(parent)
        elif otel is not None and parent is not None:  # a client's traceparent, or a BLS call's (Nested)
            parent_ctx = otel.remote_parent(parent)
            nested = parent_ctx is not None and isinstance(parent, Nested)
        if otel is None and not s["trace_file"]:
            return None
        if not nested and parent_ctx is None and not self._sample(model, s):
            return None
        record = RequestTrace(next(self._ids))
        record.append(("REQUEST_START", request.arrival_ns))
        if otel is not None:
            otel.begin(record, model, str(mv.version), request, parent_ctx, nested)
        elif nested:
            record.parent_id = parent.id  # triton mode: the ensemble's trace id, written as parent_id
        request.trace = record
        return record

    def _sample(self, model: str, s: dict) -> bool:
        """Every trace_rate-th request of a model, until trace_count requests have been traced."""
        rate = int(s["trace_rate"])
        with self._lock:
            n = self._seen.get(model, 0) + 1
            self._seen[model] = n
            if rate == 0 or n % rate:
                return False
            limit = int(s["trace_count"])
            done = self._traced.get(model, 0)
            if limit != -1 and done >= limit:
                return False
            self._traced[model] = done + 1
        return True

    def finish(self, mv, record: RequestTrace, error: BaseException | None = None) -> None:
        record.append(("REQUEST_END", time.monotonic_ns()))
        if record.span is not None:
            self._otel.end(record, error)
            return
        s = self._effective(mv.name)
        if not s["trace_file"]:
            return
        entry = {"id": record.id, "model_name": mv.name, "model_version": int(mv.version)}
        if record.parent_id is not None:
            entry["parent_id"] = record.parent_id
        with self._lock:
            entries = self._entries.setdefault(s["trace_file"], [])
            if len(entries) < _MAX_KEPT:
                entries.append(entry)
                entries.append({"id": record.id, "timestamps": [{"name": n, "ns": ns} for n, ns in record]})
            pending = len(entries) // 2
        freq = int(s["log_frequency"])
        if freq == 0 or pending % freq == 0:
            self.flush()

    def shutdown(self) -> None:
        """Write the trace files and export the spans still queued."""
        self.flush()
        if self._otel is not None:
            self._otel.shutdown()

    def flush(self) -> None:
        """Rewrite each trace file as one JSON array of everything traced into it."""
        with self._lock:
            snapshot = {path: list(entries) for path, entries in self._entries.items()}
        for path, entries in snapshot.items():
            try:
                with open(path, "w") as f:
                    json.dump(entries, f)
            except OSError as exc:
                log.error("cannot write trace file %s: %s", path, exc)

    def grpc(self, request, known_model=None):
        from tritonclient.grpc import service_pb2 as pb

        changes = {}
        for key, value in request.settings.items():
            vals = list(value.value)
            if key == "trace_level":
                changes[key] = vals or None
            else:
                changes[key] = vals[0] if vals else None
        if request.model_name and known_model is not None:
            known_model(request.model_name)
        settings = self.update(changes, request.model_name) if changes else self.get(request.model_name)
        resp = pb.TraceSettingResponse()
        for key, value in settings.items():
            resp.settings[key].value.extend(value if isinstance(value, list) else [value])
        return resp
