"""Server log settings: Triton's log formats, `--log-file` (rotation-friendly), and the logging extension
(`/v2/logging`, gRPC LogSettings) that reads and changes them at run time."""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
import time
from typing import Any

from .errors import InvalidArgument

_BOOLS = ("log_info", "log_warning", "log_error")
LOG_FORMATS = ("default", "ISO8601")
# Triton writes verbose lines with the info letter; it has no debug letter.
_LEVEL_LETTERS = {
    logging.DEBUG: "I",
    logging.INFO: "I",
    logging.WARNING: "W",
    logging.ERROR: "E",
    logging.CRITICAL: "E",
}


class TritonFormatter(logging.Formatter):
    """Triton's log line: `I1124 09:16:07.123456 4242 pool.py:120] message` (default, glog's layout) or
    `2026-11-24T09:16:07Z I 4242 pool.py:120] message` (ISO8601)."""

    def __init__(self, log_format: str = "default"):
        super().__init__()
        self.log_format = log_format

    def format(self, record: logging.LogRecord) -> str:
        level = _LEVEL_LETTERS.get(record.levelno, "I")
        where = f"{record.process} {record.filename}:{record.lineno}]"
        if self.log_format == "ISO8601":
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))
            head = f"{stamp} {level} {where}"
        else:
            t = time.localtime(record.created)
            micros = int((record.created % 1) * 1_000_000)
            head = f"{level}{t.tm_mon:02d}{t.tm_mday:02d} {time.strftime('%H:%M:%S', t)}.{micros:06d} {where}"
        message = record.getMessage()
        if "\n" not in message:
            # One-line messages are quoted and escaped as Triton 2.51 writes them, so that text a client sent
            # (a model name, a header) can never forge a log line.
            message = json.dumps(message, ensure_ascii=False)
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return f"{head} {message}"


def configure_logging(verbose: int, info: bool = True, log_format: str = "default") -> None:
    """Stderr logging in Triton's format until the server's LogSettings take over (and open --log-file): the
    process `naiad serve` starts (cli.py) and each frontend worker (engine/worker.py), from the same flags."""
    level = logging.DEBUG if verbose > 0 else (logging.INFO if info else logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TritonFormatter(log_format))
    logging.basicConfig(level=level, handlers=[handler])


class LogSettings:
    """Owns the root logger's one handler: stderr, or a file that is reopened when rotated away."""

    def __init__(
        self,
        verbose: int = 0,
        info: bool = True,
        warning: bool = True,
        error: bool = True,
        log_file: str = "",
        log_format: str = "default",
    ):
        self.settings: dict[str, Any] = {  # values checked by `update`, so typed per key there
            "log_file": log_file,
            "log_info": info,
            "log_warning": warning,
            "log_error": error,
            "log_verbose_level": verbose,
            "log_format": log_format,
        }
        self._handler: logging.Handler | None = None
        self._apply()

    @property
    def verbose(self) -> int:
        return self.settings["log_verbose_level"]

    def _open_handler(self, path: str) -> logging.Handler:
        if not path:
            return logging.StreamHandler(sys.stderr)
        try:
            # WatchedFileHandler reopens the file when logrotate moves or removes it.
            return logging.handlers.WatchedFileHandler(path, encoding="utf-8")
        except OSError as exc:
            raise InvalidArgument(f"cannot open log file '{path}': {exc.strerror or exc}") from None

    def _install(self, handler: logging.Handler) -> None:
        root = logging.getLogger()
        for old in list(root.handlers):
            root.removeHandler(old)
            if old is self._handler:
                old.close()
        root.addHandler(handler)
        self._handler = handler

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
        if self._handler is not None:
            self._handler.setFormatter(TritonFormatter(s["log_format"]))

    def configure(self, changes: dict) -> dict:
        """Apply settings at start-up or from the logging extension (the same validation for both)."""
        return self.update(changes)

    def reopen(self) -> None:
        """Reopen the log file (SIGHUP after an external rotation); a no-op when logging to stderr."""
        if self.settings["log_file"]:
            self._install(self._open_handler(self.settings["log_file"]))
            self._apply()

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
                if value not in LOG_FORMATS:
                    raise InvalidArgument("log setting 'log_format' must be 'default' or 'ISO8601'")
            elif key == "log_file":
                if not isinstance(value, str):
                    raise InvalidArgument("log setting 'log_file' must be a string")
            else:
                raise InvalidArgument(f"unknown log setting '{key}'")
            new[key] = value
        if self._handler is None or new["log_file"] != self.settings["log_file"]:
            path = new["log_file"]
            if path:
                parent = os.path.dirname(os.path.abspath(path))
                if not os.path.isdir(parent):
                    raise InvalidArgument(f"cannot open log file '{path}': no such directory '{parent}'")
            self._install(self._open_handler(path))
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
