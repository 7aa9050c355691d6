"""Samples of chosen families from a server's Prometheus text: (family, labels, value), unparsable values and NaN
left out. What the canary counters and the LLM gauges read from a pod's metrics port."""

from __future__ import annotations

import re
from collections.abc import Iterator

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def sample_pattern(families: str) -> re.Pattern[str]:
    """A pattern for labelled samples of the families matched by the regex `families`."""
    return re.compile(rf"^({families})\{{([^}}]*)\}}\s+([0-9.eE+-]+|NaN)")


def samples(text: str, pattern: re.Pattern[str]) -> Iterator[tuple[str, dict[str, str], float]]:
    """Each sample of `text` that `pattern` (from `sample_pattern`) matches, with its labels and value."""
    for line in text.splitlines():
        match = pattern.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        yield match.group(1), dict(_LABEL.findall(match.group(2))), value
