#!/usr/bin/env bash
# tools/pytest_retry.sh <run> <pytest arguments...>: run pytest as NAIAD_TEST_RUN=<run>; if tests failed, run just
# those once more as <run>-retry. For the cluster tiers only (Makefile: e2e-tests, e2e-image-tests): each runs a
# whole cluster (API server, etcd, controllers, the operator, server pods) on a 2-core VM beside another tier's,
# and a CI run failed 6 of their tests that passed in every run here, its output cut before their names. A test that
# passes the second time counts as passed and `make test`'s summary lists it as flaky, with its first error
# (tools/test_summary.py); one that fails twice fails the run. Exit status: the second run's, or the first's when
# there is nothing to run again (an error outside any test, a skip that fails a CI run).
set -uo pipefail
run="$1"
shift
py="${PY:-.venv/bin/python}"
results="${NAIAD_TEST_RESULTS:-.test-results}"
rm -f "$results/$run-retry.json"
NAIAD_TEST_RUN="$run" "$py" -m pytest "$@"
status=$?
[[ $status -ne 0 ]] || exit 0
mapfile -t ids < <("$py" tools/test_summary.py --failed "$results/$run.json")
[[ ${#ids[@]} -gt 0 ]] || exit "$status"
echo "== $run: the ${#ids[@]} failed test(s) once more (one that passes now is reported as flaky)"
NAIAD_TEST_RUN="$run-retry" "$py" -m pytest -q -rfEs "${ids[@]}"
