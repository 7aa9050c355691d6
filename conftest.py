"""Run-wide test policy: per-tier counts, failures and durations for `make test`'s summary, and under CI=true a skip
is a failure unless the test is marked `gpu` (skipped for lack of a device). Under pytest-xdist the controller
counts the reports its workers send, and only it writes the run's results."""

from __future__ import annotations

import json
import os
import resource
import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
RESULTS = Path(os.environ.get("NAIAD_TEST_RESULTS", ROOT / ".test-results"))

# Tier of a test file, by path prefix (first match wins): what a reader of the summary wants to see ran.
TIERS = [
    ("tests/operator/test_operator_cluster.py", "operator on a cluster"),
    ("tests/operator/test_operator_ha_cluster.py", "operator on a cluster"),
    ("tests/operator/test_operator_s3_cluster.py", "operator on a cluster"),
    ("tests/operator/test_operator_llm_cluster.py", "operator on a cluster"),
    ("tests/operator/test_operator_lws_cluster.py", "operator on a cluster"),
    ("e2e/", "e2e cluster"),
    ("tests/operator/", "operator"),
    ("tests/test_triton_compare.py", "triton side by side"),
    ("tests/test_prometheus.py", "prometheus"),
    ("tests/test_gpu.py", "gpu"),
    ("tests/test_images.py", "images"),
    ("tests/", "server"),
]


def tier_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    tier = next((name for prefix, name in TIERS if path.startswith(prefix)), "other")
    if os.environ.get("NAIAD_E2E_IMAGES") == "1" and tier in ("e2e cluster", "operator on a cluster"):
        tier += " (images)"  # the same scenarios with every pod started from the built images
    extra = os.environ.get("NAIAD_TEST_EXTRA_ARGS", "").strip()
    if extra:  # the same tests with every server started with these arguments (tests/helpers.py)
        tier += f" ({extra})"
    return tier


class TierCounter:
    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {}
        self.bad_skips: list[str] = []
        # each failed phase: {"id": nodeid, "when": phase, "tier": tier, "line": the error's line}, listed again at
        # the end of `make test` (tools/test_summary.py) and what a second run retries (tools/pytest_retry.sh)
        self.failures: list[dict[str, str]] = []
        # each test's setup + call + teardown seconds (the summary's slowest tests and each tier's time in tests)
        self.durations: dict[str, float] = {}
        self.started = time.time()
        self.cpu_started = _cpu_seconds()
        self.own_cpu_started = _cpu_seconds(own_only=True)
        self.workers_reported = 0  # xdist workers whose CPU arrived (pytest_testnodedown)
        self.workers_cpu = 0.0  # what xdist workers spent, each reported as it ended
        # CPU seconds by test file: this process's and what it reaped while the file's tests ran (a module's servers
        # are reaped at its end, so they count for their file); xdist workers send theirs with each report
        self.cpu_by_file: Counter = Counter()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = _cpu_seconds()
        yield
        spent = _cpu_seconds() - before
        if not hasattr(item.config, "workerinput"):
            self.cpu_by_file[item.nodeid.split("::", 1)[0]] += spent
        else:  # to the controller, with this test's last report
            item.config.naiad_cpu_spent = getattr(item.config, "naiad_cpu_spent", Counter())
            item.config.naiad_cpu_spent[item.nodeid.split("::", 1)[0]] += spent

    def pytest_testnodedown(self, node, error) -> None:  # (xdist, on the controller)
        output = getattr(node, "workeroutput", {})
        self.workers_cpu += output.get("naiad_cpu", 0.0)
        self.workers_reported += 1
        self.cpu_by_file.update(output.get("naiad_cpu_by_file", {}))

    def pytest_runtest_logreport(self, report) -> None:
        name = tier_of(report.nodeid)
        tier = self.counts.setdefault(name, Counter())
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if report.skipped:
                tier["skipped"] += 1
                if "gpu" not in report.keywords:  # (the marker's name is among the report's keywords)
                    reason = (
                        report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                    )
                    self.bad_skips.append(f"{report.nodeid}: {reason}")
            elif report.failed:
                tier["failed"] += 1
                self._failed(report, name)
            else:
                tier["passed"] += 1
        elif report.when == "teardown" and report.failed:
            tier["failed"] += 1
            self._failed(report, name)

    def _failed(self, report, tier: str) -> None:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = (
            crash.message if crash is not None else (str(report.longrepr).strip().splitlines() or [""])[-1]
        )
        line = " ".join(message.split())[:400]
        self.failures.append({"id": report.nodeid, "when": report.when, "tier": tier, "line": line})

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes") and self.bad_skips:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        name = os.environ.get("NAIAD_TEST_RUN")
        if hasattr(session.config, "workeroutput"):
            session.config.workeroutput["naiad_cpu"] = _cpu_seconds() - self.cpu_started
            session.config.workeroutput["naiad_cpu_by_file"] = dict(
                getattr(session.config, "naiad_cpu_spent", {})
            )
        if name and not hasattr(
            session.config, "workerinput"
        ):  # an xdist worker's counts reach the controller
            RESULTS.mkdir(parents=True, exist_ok=True)
            data = {
                "tiers": {k: dict(v) for k, v in self.counts.items()},
                "bad_skips": self.bad_skips,
                "failures": self.failures,
                "started": self.started,
                "wall": time.time() - self.started,
                # this process's and the children it waited for; under xdist its own and its workers' as they
                # reported them (by now the controller has reaped its workers too: counting its children as well
                # counted them twice)
                "cpu": (
                    _cpu_seconds(own_only=True) - self.own_cpu_started + self.workers_cpu
                    if self.workers_reported
                    else _cpu_seconds() - self.cpu_started
                ),
                "durations": {k: round(v, 3) for k, v in self.durations.items()},
                "tier_of": {k: tier_of(k) for k in self.durations},
                "cpu_by_file": {k: round(v, 1) for k, v in self.cpu_by_file.items()},
            }
            (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.bad_skips and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            terminalreporter.section("skips that fail a CI run (only GPU tests may skip)", red=True)
            for line in self.bad_skips:
                terminalreporter.write_line(line)


def _cpu_seconds(own_only: bool = False) -> float:
    """CPU seconds of this process and (unless `own_only`) of the children it has waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    if own_only:
        return own.ru_utime + own.ru_stime
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_configure(config) -> None:
    config.pluginmanager.register(TierCounter(), "naiad-tier-counter")
