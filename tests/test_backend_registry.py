"""The backend registry in-process: entry points that cannot be used fail with reasons; initialize once."""

from __future__ import annotations

import pytest

from naiad.backends import BackendRegistry
from naiad.errors import InvalidArgument

PLUGIN = """
from naiad.backends.api import Backend

class Counting(Backend):
    def __init__(self):
        self.calls = []

    def initialize(self):
        self.calls.append("initialize")

    def finalize(self):
        self.calls.append("finalize")

backend = Counting()
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path holding a distribution with entry points in the naiad.backends group."""
    dist = tmp_path / "regtest_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: regtest-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[naiad.backends]\n"
        "counting = regtest_plugin_mod:backend\n"
        "broken = regtest_no_such_module:backend\n"
        "weird = json:dumps\n"
    )
    (tmp_path / "regtest_plugin_mod.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_entry_point_backends_are_listed_and_initialized_once(site):
    registry = BackendRegistry()
    assert {"counting", "broken", "weird", "onnxruntime", "fil"} <= set(registry.names())
    backend = registry.get("counting")
    assert registry.get("counting") is backend
    assert backend.name == "counting"
    assert backend.calls == ["initialize"]
    registry.finalize()
    assert backend.calls == ["initialize", "finalize"]


def test_unusable_entry_points_fail_with_reasons(site):
    registry = BackendRegistry()
    with pytest.raises(
        InvalidArgument, match=r"backend 'broken' \(regtest_no_such_module:backend\) failed to import"
    ):
        registry.get("broken")
    with pytest.raises(InvalidArgument, match="neither a naiad Backend nor a module with TritonPythonModel"):
        registry.get("weird")
    with pytest.raises(InvalidArgument, match=r"unsupported backend 'nope' \(known backends: .*counting.*\)"):
        registry.get("nope")


def test_backend_directory_without_backend_or_model_class(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "model.py").write_text("X = 1\n")
    with pytest.raises(InvalidArgument, match="defines neither `backend` nor TritonPythonModel"):
        BackendRegistry(tmp_path).get("empty")
