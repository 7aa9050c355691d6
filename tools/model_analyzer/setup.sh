#!/usr/bin/env bash
# Install Triton's Model Analyzer (PyPI triton-model-analyzer) into a virtualenv of its own, cached outside the
# repository, with Triton's perf_analyzer (tools/perf_analyzer/setup.sh) next to it on its PATH. Prints the venv's
# bin directory as the last line of stdout: put it first on PATH and `model-analyzer` finds `perf_analyzer`.
#
#   ${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/model_analyzer-<hash>/venv/bin
#
# Model Analyzer 1.35.0 is the release of Triton 23.12, whose client is tritonclient 2.41.1: the perf_analyzer this
# project uses, so the flags Model Analyzer passes are ones that perf_analyzer knows. Its dependency pins (numpy,
# protobuf, tritonclient[all]) conflict with Naiad's, hence the separate venv. Idempotent; progress on stderr.
#
# Environment: PYTHON (interpreter with venv; default python3), NAIAD_TOOLS_CACHE (cache root).
set -euo pipefail

MODEL_ANALYZER_VERSION="1.35.0"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
perf_analyzer="$(bash "$here/../perf_analyzer/setup.sh" | tail -n 1)"
hash="$( { echo "$MODEL_ANALYZER_VERSION"; "$PYTHON" -c 'import sys; print(sys.version)'; cat "$here/setup.sh"; } | sha256sum | cut -c1-16)"
root="${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}"
dest="$root/model_analyzer-$hash"
bin="$dest/venv/bin"

if [[ -f "$dest/.complete" ]]; then echo "$bin"; exit 0; fi
mkdir -p "$root"
exec 9>"$root/.model_analyzer-$hash.lock"
flock 9
if [[ -f "$dest/.complete" ]]; then echo "$bin"; exit 0; fi

rm -rf "$dest"
mkdir -p "$dest"
echo "model_analyzer/setup.sh: installing triton-model-analyzer==$MODEL_ANALYZER_VERSION into $dest/venv" >&2
"$PYTHON" -m venv "$dest/venv"
"$bin/pip" install --quiet --upgrade pip >&2
# importlib_metadata: imported by model_analyzer.cli but missing from its requirements; setuptools<81 for
# pkg_resources (tritonclient.utils.shared_memory).
"$bin/pip" install --quiet "triton-model-analyzer==$MODEL_ANALYZER_VERSION" importlib_metadata "setuptools<81" >&2
printf '#!/bin/sh\n# perf_analyzer of tools/perf_analyzer/setup.sh\nexec "%s" "$@"\n' "$perf_analyzer" >"$bin/perf_analyzer"
chmod 755 "$bin/perf_analyzer"
"$bin/model-analyzer" --help >/dev/null
touch "$dest/.complete"
echo "$bin"
