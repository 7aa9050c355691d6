#!/usr/bin/env bash
# tools/step_time.sh <name> <command...>: run a build step and append "<name>\t<start>\t<end>" (epoch seconds) to
# build/steps.tsv, which `make test`'s summary prints (tools/test_summary.py). Exit status: the command's.
set -uo pipefail
name="$1"
shift
mkdir -p build
start=$(date +%s.%N)
"$@"
status=$?
printf '%s\t%s\t%s\n' "$name" "$start" "$(date +%s.%N)" >>build/steps.tsv
exit $status
