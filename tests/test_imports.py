"""No import cycles in server/ or operator/ (tools/import_cycles.py)."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def test_no_import_cycles():
    tool = ROOT / "tools" / "import_cycles.py"
    done = subprocess.run(
        [sys.executable, str(tool), "server", "operator"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout


def test_a_cycle_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    tool = ROOT / "tools" / "import_cycles.py"
    done = subprocess.run([sys.executable, str(tool), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 1 and "pkg.a <-> pkg.b" in done.stdout, done.stdout
