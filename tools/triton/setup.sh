#!/usr/bin/env bash
# Install a real NVIDIA Triton Inference Server (shipped inside the PyPI wheel
# `nvidia-pytriton`) into a virtualenv so it can serve as a reference oracle
# for Naiad. CPU only. Idempotent: re-running it is cheap and safe.
#
#   NAIAD_TRITON_VENV   venv location (default: <repo>/.venv-triton)
#   NAIAD_TRITON_PYTHON python3.11 interpreter to use (default: python3.11)
set -euo pipefail

PYTRITON_VERSION="0.7.0"          # bundles tritonserver 2.51.0 (CPU-capable, python backend)
TRITONCLIENT_VERSION="2.51.0"      # client matching the bundled server

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${NAIAD_TRITON_VENV:-$REPO/.venv-triton}"
PY="${NAIAD_TRITON_PYTHON:-python3.11}"

command -v "$PY" >/dev/null 2>&1 || { echo "setup.sh: $PY not found" >&2; exit 1; }
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "setup.sh: $PY is not python 3.11" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup.sh: creating venv $VENV"
  "$PY" -m venv "$VENV"
fi

have() {
  "$VENV/bin/python" - "$@" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    assert version(name) == want, (name, version(name), want)
import numpy, tritonclient.grpc, tritonclient.http  # noqa: F401
PYEOF
}

if ! have "nvidia-pytriton==$PYTRITON_VERSION" "tritonclient==$TRITONCLIENT_VERSION"; then
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet \
    "nvidia-pytriton==$PYTRITON_VERSION" \
    "tritonclient[all]==$TRITONCLIENT_VERSION" \
    numpy requests
fi

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
TS="$SITE/pytriton/tritonserver"
LIBS="$SITE/nvidia_pytriton.libs"
BIN="$TS/bin/tritonserver"
STUB_SRC="$TS/python_backend_stubs/3.11/triton_python_backend_stub"
STUB_DST="$TS/backends/python/triton_python_backend_stub"

for f in "$BIN" "$STUB_SRC" "$TS/backends/python/libtriton_python.so"; do
  [ -f "$f" ] || { echo "setup.sh: missing $f" >&2; exit 1; }
done
[ -d "$LIBS" ] || { echo "setup.sh: missing $LIBS" >&2; exit 1; }

# The python backend looks for the stub next to libtriton_python.so.
if ! cmp -s "$STUB_SRC" "$STUB_DST"; then
  cp "$STUB_SRC" "$STUB_DST"
fi
chmod +x "$STUB_DST" "$BIN"

# Smoke check: the binary loads its shared libraries and prints its usage
# (tritonserver --help exits 1, so look at the text, not the status).
help_out="$("$HERE/tritonserver" --help 2>&1 || true)"
case "$help_out" in
  *"Usage: tritonserver"*) ;;
  *) echo "setup.sh: tools/triton/tritonserver --help failed:" >&2
     printf '%s\n' "$help_out" | tail -20 >&2
     exit 1 ;;
esac
echo "setup.sh: ok: $BIN (pytriton $PYTRITON_VERSION) venv=$VENV"
