"""Backends as plug-ins: a pip-installed package (entry points) and a --backend-directory serve models without
any change to Naiad; unknown backends fail to load naming the known ones."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from helpers import NaiadProcess
from tritonclient.utils import InferenceServerException

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "backends"


def model(repo: Path, name: str, backend: str, extra: str = "", dims: int = 3, batch: int = 4) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}" backend: "{backend}" max_batch_size: {batch}\n'
        f'input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {dims} ] }} ]\n'
        f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]\n' + extra
    )


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """The example package pip-installed into a directory of its own, as a third party would ship it."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",  # setuptools from this environment; nothing is fetched
            "--target",
            str(target),
            str(EXAMPLES / "naiad-example-backend"),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path_factory.mktemp("build"),
    )
    assert list(target.glob("naiad_example_backend-*.dist-info/entry_points.txt"))
    return target


@pytest.fixture(scope="module")
def served(plugin_site, tmp_path_factory):
    repo = tmp_path_factory.mktemp("plugins") / "models"
    out1 = 'output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    params = 'parameters { key: "scale" value: { string_value: "2" } }\n'
    params += 'parameters { key: "offset" value: { string_value: "0.5" } }\n'
    model(
        repo, "affine", "affine", out1 + params + "dynamic_batching { max_queue_delay_microseconds: 1000000 }"
    )
    decoupled = "model_transaction_policy { decoupled: true }\n"
    model(repo, "affine_stream", "affine", out1 + params + decoupled)
    model(repo, "rowsum", "rowsum")
    model(repo, "reverse", "reverse")
    clip = 'parameters { key: "hi" value: { string_value: "0.5" } }\n'
    model(repo, "clip", "clip", clip)
    model(repo, "nosuch", "nosuch_backend")
    proc = NaiadProcess(
        repo,
        "--strict-readiness",
        "false",
        "--backend-directory",
        str(EXAMPLES / "directory"),
        "--log-verbose",
        "1",
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(plugin_site))
    try:
        proc.start()
    finally:
        mp.undo()
    yield proc
    proc.stop()


def infer(server, name: str, x: np.ndarray, outputs: list[str] | None = None) -> httpclient.InferResult:
    client = httpclient.InferenceServerClient(server.http)
    try:
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        wanted = [httpclient.InferRequestedOutput(n) for n in outputs] if outputs else None
        return client.infer(name, [inp], outputs=wanted)
    finally:
        client.close()


X = np.array([[0.25, 1.0, -2.0]], np.float32)


def test_builtins_register_through_the_entry_point_group():
    from naiad.backends import BUILTIN, GROUP

    text = (ROOT / "pyproject.toml").read_text()
    section = text.split(f'[project.entry-points."{GROUP}"]', 1)[1].split("\n[", 1)[0]
    assert dict(re.findall(r'^(\w+) = "([^"]+)"', section, re.M)) == BUILTIN


def test_native_backend_from_an_installed_package(served):
    result = infer(served, "affine", X)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), X * 2 + 0.5)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), (X * 2 + 0.5).sum(axis=1, keepdims=True))
    only = infer(served, "affine", X, ["OUTPUT1"])
    assert only.as_numpy("OUTPUT0") is None
    np.testing.assert_allclose(only.as_numpy("OUTPUT1"), [[0.0]])


def test_per_request_error_does_not_fail_the_batch(served):
    rows = [X + i for i in range(4)]
    rows[2] = np.full_like(X, np.nan)

    def call(x):
        try:
            return infer(served, "affine", x).as_numpy("OUTPUT0")
        except InferenceServerException as exc:
            return exc

    client = httpclient.InferenceServerClient(served.http)
    before = client.get_inference_statistics("affine")["model_stats"][0]["execution_count"]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, rows))
    after = client.get_inference_statistics("affine")["model_stats"][0]["execution_count"]
    client.close()
    assert isinstance(results[2], InferenceServerException) and "INPUT0 contains NaN" in str(results[2])
    assert results[2].status() == "400"  # InvalidArgument, as the backend said
    for i in (0, 1, 3):
        np.testing.assert_allclose(results[i], rows[i] * 2 + 0.5)
    assert after - before == 1  # all four rode in one execution (max_batch_size 4)


def test_decoupled_backend_streams_one_response_per_row(served):
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    x = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    client.async_stream_infer("affine_stream", [inp], enable_empty_final_response=True)
    got = []
    while True:
        result, error = responses.get(timeout=30)
        assert error is None, error
        final = result.get_response().parameters["triton_final_response"].bool_param
        if result.as_numpy("OUTPUT0") is not None:
            got.append(result.as_numpy("OUTPUT0"))
        if final:
            break
    client.stop_stream()
    client.close()
    assert len(got) == 2
    np.testing.assert_allclose(np.concatenate(got), x * 2 + 0.5)


def test_triton_python_model_from_an_installed_package(served):
    np.testing.assert_allclose(infer(served, "rowsum", X).as_numpy("OUTPUT0"), X.sum(axis=1, keepdims=True))


def test_triton_python_model_plugin_is_the_first_backend_loaded(plugin_site, tmp_path, monkeypatch):
    """Its `import triton_python_backend_utils` must work before any python model has loaded."""
    model(tmp_path, "rowsum", "rowsum")
    monkeypatch.setenv("PYTHONPATH", str(plugin_site))
    with NaiadProcess(tmp_path) as server:
        np.testing.assert_allclose(infer(server, "rowsum", X).as_numpy("OUTPUT0"), [[-0.75]])


def test_backend_directory_python_based_and_native(served):
    np.testing.assert_allclose(infer(served, "reverse", X).as_numpy("OUTPUT0"), X[:, ::-1])
    np.testing.assert_allclose(infer(served, "clip", X).as_numpy("OUTPUT0"), np.clip(X, 0, 0.5))


def test_unknown_backend_fails_to_load_naming_the_known_ones(served):
    client = httpclient.InferenceServerClient(served.http)
    try:
        index = {m["name"]: m for m in client.get_model_repository_index()}
    finally:
        client.close()
    reason = index["nosuch"]["reason"]
    assert "unsupported backend 'nosuch_backend'" in reason
    for known in (
        "affine",
        "rowsum",
        "reverse",
        "clip",
        "fil",
        "onnxruntime",
        "python",
        "pytorch",
        "tensorrt",
    ):
        assert known in reason


def test_lifecycle_hooks_run_in_order(served, tmp_path):
    served.stop()
    log = Path(served.log_path).read_text()
    order = [
        "affine backend initialized",
        "affine model affine version 1 initialized",
        "affine instance affine_0 initialized on CPU 0",
        "affine model affine version 1 finalized",
        "affine backend finalized",
    ]
    positions = [log.find(line) for line in order]
    assert all(p >= 0 for p in positions), (order, log[-3000:])
    assert positions == sorted(positions)
