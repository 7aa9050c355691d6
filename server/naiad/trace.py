"""Trace extension (`/v2/trace/setting`, gRPC TraceSetting): TIMESTAMPS traces of sampled requests, as JSON.

Each traced request gets a model record and a timestamps record in the trace file, as Triton writes them:
`[{"id": 1, "model_name": "m", "model_version": 1}, {"id": 1, "timestamps": [{"name": "REQUEST_START",
"ns": ...}, ...]}, ...]`. Timestamps are monotonic-clock nanoseconds, like Triton's steady clock.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading

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
_MAX_KEPT = 100_000


class Tracer:
    def __init__(self, settings: dict | None = None):
        self.global_settings = dict(DEFAULTS)
        self.model_settings: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._seen: dict[str, int] = {}
        self._traced: dict[str, int] = {}
        self._entries: dict[str, list] = {}
        self._active = False  # any setting asks for TIMESTAMPS: requests skip the tracer entirely otherwise
        if settings:
            self.update(settings)

    # ---- settings ----
    def _validated(self, changes: dict) -> dict:
        out = {}
        for key, value in changes.items():
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
            elif key in ("trace_rate", "trace_count", "log_frequency"):
                try:
                    n = int(value)
                except (TypeError, ValueError):
                    raise InvalidArgument(f"trace setting '{key}' must be an integer") from None
                if n < (-1 if key == "trace_count" else 0) or (key == "trace_rate" and n == 0):
                    raise InvalidArgument(f"trace setting '{key}' is out of range: {n}")
                out[key] = str(n)
            else:
                out[key] = str(value)
        return out

    def get(self, model: str = "") -> dict:
        with self._lock:
            merged = dict(self.global_settings)
            merged.update(self.model_settings.get(model, {}))
            return merged

    def update(self, changes: dict, model: str = "") -> dict:
        if not isinstance(changes, dict):
            raise InvalidArgument("trace settings must be a JSON object")
        valid = self._validated(changes)
        with self._lock:
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
            self._active = any(
                "TIMESTAMPS" in s.get("trace_level", ())
                for s in [self.global_settings, *self.model_settings.values()]
            )
        self.flush()
        return self.get(model)

    # ---- tracing ----
    def start(self, model: str) -> list | None:
        """A timestamps list for this request when it is sampled, else None. Free when tracing is off."""
        if not self._active:
            return None
        s = self.get(model)
        if "TIMESTAMPS" not in s["trace_level"] or not s["trace_file"]:
            return None
        with self._lock:
            n = self._seen.get(model, 0) + 1
            self._seen[model] = n
            if n % int(s["trace_rate"]):
                return None
            limit = int(s["trace_count"])
            done = self._traced.get(model, 0)
            if limit != -1 and done >= limit:
                return None
            self._traced[model] = done + 1
        return []

    def finish(self, model: str, version: str, timestamps: list) -> None:
        s = self.get(model)
        trace_id = next(self._ids)
        with self._lock:
            entries = self._entries.setdefault(s["trace_file"], [])
            if len(entries) < _MAX_KEPT:
                entries.append({"id": trace_id, "model_name": model, "model_version": int(version)})
                entries.append(
                    {"id": trace_id, "timestamps": [{"name": n, "ns": ns} for n, ns in timestamps]}
                )
            pending = len(entries) // 2
        freq = int(s["log_frequency"])
        if freq == 0 or pending % freq == 0:
            self.flush()

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
