"""Logging extension (`/v2/logging`, gRPC LogSettings): read and change log settings at run time."""

from __future__ import annotations

import logging

from .errors import InvalidArgument

_BOOLS = ("log_info", "log_warning", "log_error")


class LogSettings:
    def __init__(
        self,
        verbose: int = 0,
        info: bool = True,
        warning: bool = True,
        error: bool = True,
        log_file: str = "",
        log_format: str = "default",
    ):
        self.settings = {
            "log_file": log_file,
            "log_info": info,
            "log_warning": warning,
            "log_error": error,
            "log_verbose_level": verbose,
            "log_format": log_format,
        }
        self._apply()

    def _apply(self) -> None:
        s = self.settings
        if s["log_verbose_level"] > 0:
            level = logging.DEBUG
        elif s["log_info"]:
            level = logging.INFO
        elif s["log_warning"]:
            level = logging.WARNING
        elif s["log_error"]:
            level = logging.ERROR
        else:
            level = logging.CRITICAL + 1
        logging.getLogger("naiad").setLevel(level)
        logging.getLogger().setLevel(level)

    def get(self) -> dict:
        return dict(self.settings)

    def update(self, changes: dict) -> dict:
        if not isinstance(changes, dict):
            raise InvalidArgument("log settings must be a JSON object")
        new = dict(self.settings)
        for key, value in changes.items():
            if key in _BOOLS:
                if not isinstance(value, bool):
                    raise InvalidArgument(f"log setting '{key}' must be a boolean")
            elif key == "log_verbose_level":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidArgument("log setting 'log_verbose_level' must be a non-negative integer")
            elif key == "log_format":
                if value not in ("default", "ISO8601"):
                    raise InvalidArgument("log setting 'log_format' must be 'default' or 'ISO8601'")
            elif key == "log_file":
                if value not in ("", self.settings["log_file"]):
                    raise InvalidArgument(
                        "changing 'log_file' at run time is not supported; Naiad logs to stderr"
                    )
            else:
                raise InvalidArgument(f"unknown log setting '{key}'")
            new[key] = value
        self.settings = new
        self._apply()
        return self.get()

    def grpc(self, request):
        from tritonclient.grpc import service_pb2 as pb

        changes = {}
        for key, p in request.settings.items():
            kind = p.WhichOneof("parameter_choice")
            changes[key] = getattr(p, kind) if kind else None
        settings = self.update(changes) if changes else self.get()
        resp = pb.LogSettingsResponse()
        for key, value in settings.items():
            entry = resp.settings[key]
            if isinstance(value, bool):
                entry.bool_param = value
            elif isinstance(value, int):
                entry.uint32_param = value
            else:
                entry.string_param = value
        return resp
