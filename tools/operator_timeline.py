"""Where apply -> Available goes, per model, from an operator log written with NAIAD_TIMELINE=1 (the
`naiad_operator.timeline` lines) and the times each model was applied and seen Available (a JSON file
{"<namespace>/<model>": {"sent": <unix time>, "available": <unix time>}}, as the scale and latency benchmarks write).

    python tools/operator_timeline.py operator.log times.json

Stages of each model (seconds; medians, p95 and max over the models):

    watch      kubectl apply sent -> the operator's first watch event of the model
    handler    first event -> the create handler starts (kopf: the finalizer patch and its echo, the batch window)
    children   handler start -> a pass requested (shared pool: at once, the Services are applied alongside;
               dedicated pool: once the model's children, its pool among them, are applied)
    queue      pass requested -> the pool pass that loads the model starts (waiting for the pass in progress)
    read       that pass starts -> the model's load starts (the pass's reads, `Loading` statuses, load slots)
    load       load request -> the server answered (the server's load time)
    status     load answered -> status `Available` written (other loads of the pass, pod labels, statuses)
    echo       status written -> the watch (kubectl get -w) saw `Available`
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"timeline (\d+\.\d+) (\S+) (\S+) ?(.*)$")
STAGES = ("watch", "handler", "children", "queue", "read", "load", "status", "echo")


def parse(log: str) -> dict[str, list[tuple[float, str, str]]]:
    marks: dict[str, list[tuple[float, str, str]]] = defaultdict(list)
    for line in log.splitlines():
        match = LINE.search(line)
        if match:
            marks[match.group(2)].append((float(match.group(1)), match.group(3), match.group(4).strip()))
    return marks


def first(marks: list[tuple[float, str, str]], stage: str, after: float = 0.0, detail: str | None = None):
    for at, name, text in marks:
        if name == stage and at >= after and (detail is None or text == detail):
            return at, text
    return None


def breakdown(marks: dict[str, list[tuple[float, str, str]]], times: dict[str, dict[str, float]]):
    rows = {}
    for key, seen in times.items():
        own = marks.get(key, [])
        namespace = key.split("/", 1)[0]
        event = first(own, "event", seen["sent"] - 1)
        handler = first(own, "handler", seen["sent"] - 1)
        requested = first(own, "requested", seen["sent"] - 1)
        load_start = first(own, "load-start", seen["sent"] - 1)
        load_end = first(own, "load-end", seen["sent"] - 1)
        status = first(own, "status", seen["sent"] - 1, "Available")
        if None in (event, handler, requested, load_start, load_end, status) or "available" not in seen:
            continue
        pool = requested[1]
        pass_start = None
        for at, name, _ in marks.get(f"{namespace}/pool:{pool}", []):
            if name == "pass-start" and at <= load_start[0]:
                pass_start = at
        if pass_start is None:
            continue
        # The pass that loaded it may have started before the request (it then read the model from the index).
        queue_end = max(pass_start, requested[0])
        rows[key] = {
            "watch": event[0] - seen["sent"],
            "handler": handler[0] - event[0],
            "children": requested[0] - handler[0],
            "queue": queue_end - requested[0],
            "read": load_start[0] - queue_end,
            "load": load_end[0] - load_start[0],
            "status": status[0] - load_end[0],
            "echo": seen["available"] - status[0],
            "total": seen["available"] - seen["sent"],
        }
    return rows


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summary(rows: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for stage in (*STAGES, "total"):
        values = [r[stage] for r in rows.values()]
        if values:
            out[stage] = {
                "p50": round(statistics.median(values), 2),
                "p95": round(percentile(values, 95), 2),
                "max": round(max(values), 2),
            }
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    marks = parse(Path(argv[0]).read_text(errors="replace"))
    times = json.loads(Path(argv[1]).read_text())
    rows = breakdown(marks, times)
    print(f"{len(rows)} of {len(times)} models with a complete timeline")
    print(json.dumps(summary(rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
