#!/usr/bin/env bash
# Fetch Triton's perf_analyzer (a C++ client) into a cache outside the repository and print the path of a wrapper
# that runs it:
#
#   ${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/perf_analyzer-<hash>/perf_analyzer
#
# Current tritonclient wheels no longer ship it; the tritonclient==2.41.1 manylinux x86_64 wheel does
# (bin/perf_analyzer). It links against libb64 (Debian's libb64-0d, installed with apt-get when run as root) and
# libcudart.so.12 (PyPI's nvidia-cuda-runtime-cu12). Both wheels are downloaded with pip and unpacked here; they are
# never installed into a virtualenv (the project's venv has tritonclient>=2.51). Idempotent: a finished cache is
# a no-op. Progress goes to stderr, the wrapper's path is the last line of stdout.
#
# Environment: PYTHON (interpreter with pip; default python3), NAIAD_TOOLS_CACHE (cache root).
set -euo pipefail

TRITONCLIENT_VERSION="2.41.1"
CUDART_VERSION="12.4.127"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
hash="$( { echo "$TRITONCLIENT_VERSION $CUDART_VERSION"; uname -m; cat "$here/setup.sh"; } | sha256sum | cut -c1-16)"
root="${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}"
dest="$root/perf_analyzer-$hash"
wrapper="$dest/perf_analyzer"

have_libb64() { ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; }

if [[ -f "$dest/.complete" ]] && have_libb64; then echo "$wrapper"; exit 0; fi
[[ "$(uname -m)" == x86_64 ]] || { echo "perf_analyzer/setup.sh: the wheel is x86_64 only" >&2; exit 2; }

if ! have_libb64; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "perf_analyzer/setup.sh: installing libb64-0d with apt-get" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libb64-0d >&2 \
      || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libb64-0d >&2; }
  else
    echo "perf_analyzer/setup.sh: libb64.so.0d missing; run 'apt-get install libb64-0d' as root" >&2
    exit 3
  fi
fi

mkdir -p "$root"
exec 9>"$root/.perf_analyzer-$hash.lock"
flock 9
if [[ -f "$dest/.complete" ]]; then echo "$wrapper"; exit 0; fi

tmp="$(mktemp -d "$root/.perf_analyzer-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "perf_analyzer/setup.sh: downloading tritonclient==$TRITONCLIENT_VERSION, nvidia-cuda-runtime-cu12==$CUDART_VERSION" >&2
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
  --python-version 3.10 --implementation py --dest "$tmp/wheels" "tritonclient==$TRITONCLIENT_VERSION" >&2
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
  --python-version 3.10 --dest "$tmp/wheels" "nvidia-cuda-runtime-cu12==$CUDART_VERSION" >&2

mkdir -p "$tmp/out/bin" "$tmp/out/lib"
"$PYTHON" - "$tmp/wheels" "$tmp/out" <<'PYEOF'
import pathlib, shutil, sys, zipfile

wheels, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for whl in wheels.glob("*.whl"):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if name.endswith("/bin/perf_analyzer") or name == "tritonclient/bin/perf_analyzer":
                target = out / "bin" / "perf_analyzer"
            elif "/lib/libcudart.so" in name:
                target = out / "lib" / pathlib.Path(name).name
            else:
                continue
            with z.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
PYEOF
[[ -f "$tmp/out/bin/perf_analyzer" ]] || { echo "perf_analyzer/setup.sh: no bin/perf_analyzer in the wheel" >&2; exit 4; }
ls "$tmp/out/lib"/libcudart.so.12* >/dev/null 2>&1 || { echo "perf_analyzer/setup.sh: no libcudart.so.12" >&2; exit 4; }
chmod 755 "$tmp/out/bin/perf_analyzer"
cat > "$tmp/out/perf_analyzer" <<'WEOF'
#!/usr/bin/env bash
# perf_analyzer from the tritonclient 2.41.1 wheel, with its bundled libcudart.so.12 on the library path.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/bin/perf_analyzer" "$@"
WEOF
chmod 755 "$tmp/out/perf_analyzer"
"$tmp/out/perf_analyzer" --version >/dev/null 2>&1 || "$tmp/out/perf_analyzer" --help >/dev/null 2>&1 || {
  echo "perf_analyzer/setup.sh: the binary does not run:" >&2
  LD_LIBRARY_PATH="$tmp/out/lib" ldd "$tmp/out/bin/perf_analyzer" | grep 'not found' >&2 || true
  exit 5
}
rm -rf "$dest"
mv "$tmp/out" "$dest"
touch "$dest/.complete"
echo "$wrapper"
