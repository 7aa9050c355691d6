"""No import cycles in server/ or operator/ (tools/import_cycles.py), and the server's imports run down its
declared order of rooms (tools/import_rooms.py)."""

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


def test_rooms_in_order():
    tool = ROOT / "tools" / "import_rooms.py"
    done = subprocess.run([sys.executable, str(tool), "server"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_an_import_out_of_order_is_found(tmp_path):
    files = {
        "naiad/__init__.py": "",
        "naiad/cli.py": "",
        "naiad/errors.py": "def f():\n    from .cli import main\n",  # up
        "naiad/frontends/__init__.py": "",
        "naiad/frontends/http/__init__.py": "",
        "naiad/frontends/http/app.py": "from ..grpc import server\n",  # sideways: protocol to protocol
        "naiad/frontends/grpc/__init__.py": "",
        "naiad/frontends/grpc/server.py": "from .h2 import reader\n",  # down
        "naiad/frontends/grpc/h2/__init__.py": "",
        "naiad/frontends/grpc/h2/reader.py": "from .. import server\n",  # up: h2 below gRPC
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    tool = ROOT / "tools" / "import_rooms.py"
    done = subprocess.run([sys.executable, str(tool), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 1, done.stdout
    assert "naiad.errors -> naiad.cli runs up" in done.stdout
    assert "naiad.frontends.http.app -> naiad.frontends.grpc.server runs sideways" in done.stdout
    assert "naiad.frontends.grpc.h2.reader -> naiad.frontends.grpc.server runs up" in done.stdout
    assert "naiad.frontends.grpc.server -> naiad.frontends.grpc.h2.reader" not in done.stdout
