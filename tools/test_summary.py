"""Print `make test`'s per-tier summary and every failed test from the runs' result files (CI shows the end of
a run's output: the failures must be there); exit 1 on a failure, or under CI=true on a non-GPU skip."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path


def main() -> int:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else ".test-results")
    tiers: dict[str, Counter] = {}
    bad: list[str] = []
    failures: list[str] = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        for tier, counts in data["tiers"].items():
            tiers.setdefault(tier, Counter()).update(counts)
        bad += data.get("bad_skips", [])
        failures += [f"[{path.stem}] {line}" for line in data.get("failures", [])]
    if not tiers:
        print("make test: no test results found", file=sys.stderr)
        return 1
    width = max(len(t) for t in tiers)
    print(f"\n{'tier':<{width}}  passed  failed  skipped")
    total: Counter = Counter()
    for tier, c in sorted(tiers.items()):
        total.update(c)
        print(f"{tier:<{width}}  {c['passed']:>6}  {c['failed']:>6}  {c['skipped']:>7}")
    print(f"{'all':<{width}}  {total['passed']:>6}  {total['failed']:>6}  {total['skipped']:>7}")
    if failures:
        print(f"\n{len(failures)} failed (each run's output above has the whole report):")
        for line in failures:
            print(f"  {line}")
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    if bad:
        print(f"\n{len(bad)} non-GPU skip(s){' (a failure under CI=true)' if ci else ''}:")
        for line in bad:
            print(f"  {line}")
    return 1 if (ci and bad) or total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
