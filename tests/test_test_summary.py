"""`make test`'s summary (tools/test_summary.py): failures listed at the end, and a cluster tier's second run
(tools/pytest_retry.sh) turning a test that passed there into a pass listed as flaky."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT

SUMMARY = ROOT / "tools" / "test_summary.py"


def _run(results, *args) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin"}  # (no CI=true: a skip is not a failure here)
    return subprocess.run(
        [sys.executable, str(SUMMARY), *args, str(results)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def _failure(nodeid: str, line: str, when: str = "call", tier: str = "e2e cluster") -> dict:
    return {"id": nodeid, "when": when, "tier": tier, "line": line}


def test_a_test_that_passes_its_second_run_counts_as_passed_and_is_listed_as_flaky(tmp_path):
    first = {
        "tiers": {"e2e cluster": {"passed": 5, "failed": 3}},
        "bad_skips": [],
        "failures": [
            _failure("e2e/a.py::test_flaky", "TimeoutError: pods"),
            _failure("e2e/a.py::test_broken", "AssertionError: 1 != 2"),
            _failure("e2e/a.py::test_teardown", "OSError: busy", when="teardown"),
        ],
    }
    retry = {
        "tiers": {"e2e cluster": {"passed": 2, "failed": 1}},
        "bad_skips": [],
        "failures": [_failure("e2e/a.py::test_broken", "AssertionError: 1 != 3")],
    }
    (tmp_path / "cluster.json").write_text(json.dumps(first))
    (tmp_path / "cluster-retry.json").write_text(json.dumps(retry))
    (tmp_path / "server.json").write_text(json.dumps({"tiers": {"server": {"passed": 7}}, "bad_skips": []}))
    done = _run(tmp_path)
    assert done.returncode == 1, done.stdout  # one test failed twice
    # the flaky test's pass is added; the teardown's test had been counted as passed already; the retry's own
    # counts are not added again
    assert "e2e cluster       6       1        0" in done.stdout
    assert "all              13       1        0" in done.stdout
    flaky, failed = done.stdout.split("failed once and passed when run again")[1].split("failure(s)")
    assert "test_flaky (call): TimeoutError: pods" in flaky and "test_teardown (teardown)" in flaky
    assert "[cluster] e2e/a.py::test_broken (call): AssertionError: 1 != 2" in failed
    assert "[cluster-retry] e2e/a.py::test_broken (call): AssertionError: 1 != 3" in failed

    listed = subprocess.run(
        [sys.executable, str(SUMMARY), "--failed", str(tmp_path / "cluster.json")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert listed.stdout.split() == [
        "e2e/a.py::test_flaky",
        "e2e/a.py::test_broken",
        "e2e/a.py::test_teardown",
    ]


def test_all_passed_on_the_second_run_passes(tmp_path):
    first = {"tiers": {"e2e cluster": {"passed": 1, "failed": 1}}, "failures": [_failure("e2e/a.py::t", "x")]}
    (tmp_path / "cluster.json").write_text(json.dumps(first))
    (tmp_path / "cluster-retry.json").write_text(
        json.dumps({"tiers": {"e2e cluster": {"passed": 1}}, "failures": []})
    )
    done = _run(tmp_path)
    assert done.returncode == 0, done.stdout
    assert "all               2       0        0" in done.stdout and "1 failed once" in done.stdout
