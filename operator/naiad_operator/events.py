"""Kubernetes Events on the operator's objects, posted through kopf's event queue (logged instead when no
operator is running, e.g. in tests or scripts)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

log = logging.getLogger(__name__)


def post(body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    """kind is Normal or Warning."""
    try:
        # kopf.event reads any mapping (apiVersion, kind, metadata); its annotation names kopf.Body only.
        kopf.event(dict(body), type=kind, reason=reason, message=message)  # type: ignore[arg-type]
    except LookupError:
        log.info("%s %s %s: %s", kind, reason, body["metadata"]["name"], message)
