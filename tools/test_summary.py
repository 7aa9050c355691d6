"""Print `make test`'s per-tier summary and every failed test from the runs' result files (CI shows the end of
a run's output: the failures must be there); exit 1 on a failure, or under CI=true on a non-GPU skip.

The summary also says where the time went: each pytest run's wall time, each tier's time in tests (setup, call and
teardown summed) with its ten slowest tests, and the build steps' times from `build/steps.tsv` (lines of name,
start and end in epoch seconds, written by the Makefile's `tools/step_time.sh`).

A run `<name>` that failed may have been followed by `<name>-retry`, its failed tests once more
(tools/pytest_retry.sh): a test that passed there counts as passed, and is listed as flaky with its first error.
`--failed FILE` prints the node ids of the tests that failed in one result file, a line each (what the retry runs).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

RETRY = "-retry"


def failed_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    failures = json.loads(path.read_text()).get("failures", [])
    return list(dict.fromkeys(f["id"] for f in failures))


def _clock(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60}m{whole % 60:02d}s"


def print_times(runs: dict[str, dict], steps: Path, slowest: int = 10) -> None:
    """Where the run's time went: the build steps, each pytest run, each tier and its slowest tests."""
    if steps.exists():
        rows = [line.split("\t") for line in steps.read_text().splitlines() if line.count("\t") == 2]
        if rows:
            first = min(float(r[1]) for r in rows)
            print("\nbuild steps (start after the first, duration):")
            for name, start, end in rows:
                print(
                    f"  {name:<28} +{_clock(float(start) - first):>7}  {_clock(float(end) - float(start)):>7}"
                )
    timed = {name: data for name, data in runs.items() if "wall" in data}
    if not timed:
        return
    print("\npytest runs (wall time):")
    for name, data in timed.items():
        cpu = f", {_clock(data['cpu'])} of CPU" if "cpu" in data else ""
        print(f"  {name:<28} {_clock(data['wall']):>7}  ({len(data.get('durations', {}))} tests{cpu})")
    spent: dict[str, dict[str, float]] = {}
    for name, data in timed.items():
        tier_of = data.get("tier_of", {})
        for nodeid, seconds in data.get("durations", {}).items():
            spent.setdefault(tier_of.get(nodeid, name), {})[f"[{name}] {nodeid}"] = seconds
    by_file: Counter = Counter()
    for name, data in timed.items():
        by_file.update({f"[{name}] {path}": cpu for path, cpu in data.get("cpu_by_file", {}).items()})
    if by_file:
        print(
            f"\nCPU by test file (the file's tests and the servers they reaped), the {slowest * 2} costliest:"
        )
        for path, cpu in by_file.most_common(slowest * 2):
            print(f"  {_clock(cpu):>7}  {path}")
    print(f"\ntime in tests by tier, and each tier's {slowest} slowest:")
    for tier, tests in sorted(spent.items(), key=lambda kv: -sum(kv[1].values())):
        print(f"  {tier}: {_clock(sum(tests.values()))} in {len(tests)} tests")
        for nodeid, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:slowest]:
            print(f"    {seconds:7.1f}s  {nodeid}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--failed"]:
        for nodeid in failed_ids(Path(argv[1])):
            print(nodeid)
        return 0
    results = Path(argv[0] if argv else ".test-results")
    runs = {path.stem: json.loads(path.read_text()) for path in sorted(results.glob("*.json"))}
    tiers: dict[str, Counter] = {}
    bad: list[str] = []
    failures: list[str] = []
    flaky: list[str] = []
    for name, data in runs.items():
        bad += data.get("bad_skips", [])
        if name.endswith(RETRY) and name[: -len(RETRY)] in runs:
            continue  # counted with the run it retried
        retry = runs.get(name + RETRY)
        failed_again = {f["id"] for f in retry["failures"]} if retry is not None else None
        counts = {tier: Counter(c) for tier, c in data["tiers"].items()}
        for f in data.get("failures", []):
            if failed_again is not None and f["id"] not in failed_again:
                counts[f["tier"]]["failed"] -= 1
                if f["when"] != "teardown":  # (a failed teardown's test was counted as passed already)
                    counts[f["tier"]]["passed"] += 1
                flaky.append(f"[{name}] {f['id']} ({f['when']}): {f['line']}")
            else:
                failures.append(f"[{name}] {f['id']} ({f['when']}): {f['line']}")
        if retry is not None:  # the second run's own errors, for the tests that failed twice
            failures += [f"[{name}{RETRY}] {f['id']} ({f['when']}): {f['line']}" for f in retry["failures"]]
        for tier, c in counts.items():
            tiers.setdefault(tier, Counter()).update(c)
    if not tiers:
        print("make test: no test results found", file=sys.stderr)
        return 1
    print_times(runs, results.parent / "build" / "steps.tsv")
    width = max(len(t) for t in tiers)
    print(f"\n{'tier':<{width}}  passed  failed  skipped")
    total: Counter = Counter()
    for tier, c in sorted(tiers.items()):
        total.update(c)
        print(f"{tier:<{width}}  {c['passed']:>6}  {c['failed']:>6}  {c['skipped']:>7}")
    print(f"{'all':<{width}}  {total['passed']:>6}  {total['failed']:>6}  {total['skipped']:>7}")
    if flaky:
        print(f"\n{len(flaky)} failed once and passed when run again (flaky: each is a bug to find):")
        for line in flaky:
            print(f"  {line}")
    if failures:
        print(
            f"\n{len(failures)} failure(s), a second run's too (each run's output above has the whole report):"
        )
        for line in failures:
            print(f"  {line}")
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    if bad:
        print(f"\n{len(bad)} non-GPU skip(s){' (a failure under CI=true)' if ci else ''}:")
        for line in bad:
            print(f"  {line}")
    return 1 if (ci and bad) or total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
