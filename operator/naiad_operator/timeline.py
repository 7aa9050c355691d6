"""Per-model timestamps of what the operator does between a change and the status that reports it (handler,
pass, load, status write), for measuring apply -> Available. Off unless $NAIAD_TIMELINE is set (a debug logger);
tools/operator_timeline.py turns the lines into a breakdown."""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("naiad_operator.timeline")


def enable_from_env() -> None:
    if os.environ.get("NAIAD_TIMELINE", "").lower() in ("1", "true", "yes"):
        log.setLevel(logging.DEBUG)


def mark(namespace: str, name: str, stage: str, detail: str = "") -> None:
    """One line: `timeline <unix time> <namespace>/<name> <stage> <detail>`."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("timeline %.3f %s/%s %s %s", time.time(), namespace, name, stage, detail)
