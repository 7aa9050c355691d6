"""Model control (none / poll / explicit), load overrides, failures in isolation, drain on SIGTERM."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from helpers import ROOT, NaiadProcess
from tritonclient.utils import InferenceServerException


@pytest.fixture()
def explicit(model_repo):
    with NaiadProcess(model_repo, "--model-control-mode", "explicit", "--load-model", "add_sub") as proc:
        yield proc


def index(proc):
    return {(m["name"], m.get("state")) for m in requests.post(f"{proc.url}/v2/repository/index").json()}


def add_sub_inputs(client_mod):
    ins = [client_mod.InferInput("INPUT0", [4], "FP32"), client_mod.InferInput("INPUT1", [4], "FP32")]
    ins[0].set_data_from_numpy(np.arange(4, dtype=np.float32))
    ins[1].set_data_from_numpy(np.ones(4, dtype=np.float32))
    return ins


def test_explicit_load_unload_http(explicit):
    client = httpclient.InferenceServerClient(explicit.http)
    assert ("add_sub", "READY") in index(explicit)
    assert not client.is_model_ready("identity_fp32")
    names = {m["name"] for m in client.get_model_repository_index()}
    assert {"identity_fp32", "mlp_onnx", "broken_init"} <= names
    client.load_model("identity_fp32")
    assert client.is_model_ready("identity_fp32")
    client.unload_model("identity_fp32")
    assert not client.is_model_ready("identity_fp32")
    assert ("identity_fp32", "UNAVAILABLE") in index(explicit)
    client.unload_model("never_heard_of_it")  # Triton answers 200 here too


def test_load_and_unload_parameters_that_are_not_an_object_are_refused(explicit):
    """400, and nothing loaded or unloaded (an unload with a list of parameters failed with 500 before, and an
    empty list read as no parameters)."""
    for action, params in (("load", []), ("load", "x"), ("unload", [1]), ("unload", 3)):
        r = requests.post(
            f"{explicit.url}/v2/repository/models/add_sub/{action}", json={"parameters": params}
        )
        assert r.status_code == 400, r.text
        assert r.json() == {"error": "'parameters' must be a JSON object"}
    assert ("add_sub", "READY") in index(explicit)
    r = requests.post(
        f"{explicit.url}/v2/repository/models/identity_fp32/load", json={"parameters": {"foo": "x"}}
    )
    assert r.status_code == 400 and r.json() == {"error": "unrecognized load parameter 'foo'."}
    assert ("identity_fp32", "READY") not in index(explicit)
    r = requests.post(f"{explicit.url}/v2/repository/index", json={"ready": "yes"})
    assert r.status_code == 400
    assert r.json() == {"error": "Unable to parse 'ready': attempt to access JSON non-boolean as boolean"}
    r = requests.post(f"{explicit.url}/v2/repository/index", json={"ready": True})
    assert {m["name"] for m in r.json()} == {"add_sub"}


def test_explicit_load_unload_grpc(explicit):
    client = grpcclient.InferenceServerClient(explicit.grpc)
    client.load_model("mlp_onnx")
    assert client.is_model_ready("mlp_onnx")
    client.unload_model("mlp_onnx")
    assert not client.is_model_ready("mlp_onnx")


def test_broken_model_load_fails_alone(explicit):
    client = httpclient.InferenceServerClient(explicit.http)
    with pytest.raises(InferenceServerException, match="broken on purpose"):
        client.load_model("broken_init")
    with pytest.raises(InferenceServerException):
        client.load_model("does_not_exist")
    # the loaded model is unaffected
    assert client.infer("add_sub", add_sub_inputs(httpclient)).as_numpy("OUTPUT0").tolist() == [1, 2, 3, 4]
    entry = next(m for m in client.get_model_repository_index() if m["name"] == "broken_init")
    assert entry["state"] == "UNAVAILABLE" and "broken on purpose" in entry["reason"]


# identity_fp32's config with max_batch_size 2 (the repository's says 8): a config override a load can tell apart
IDENTITY_BATCH_2 = {
    "name": "identity_fp32",
    "backend": "python",
    "max_batch_size": 2,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
}


def test_load_with_config_override(explicit):
    client = httpclient.InferenceServerClient(explicit.http)
    override = IDENTITY_BATCH_2
    client.load_model("identity_fp32", config=json.dumps(override))
    assert client.get_model_config("identity_fp32")["max_batch_size"] == 2
    inp = httpclient.InferInput("INPUT0", [3, 1], "FP32")
    inp.set_data_from_numpy(np.zeros((3, 1), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="batch-size must be <= 2"):
        client.infer("identity_fp32", [inp])
    # reload from the repository config: max_batch_size back to 8, no restart
    client.load_model("identity_fp32")
    assert client.get_model_config("identity_fp32")["max_batch_size"] == 8
    with pytest.raises(InferenceServerException, match="parse"):
        client.load_model("identity_fp32", config="{not json")
    assert client.is_model_ready("identity_fp32")  # a failed reload keeps the old version serving


def test_load_model_config_at_startup(model_repo):
    """--load-model-config: a startup load with a config override, as the load API's `config` parameter (the
    operator starts a LeaderWorkerSet group's leader with its model's parallel sizes this way)."""
    override = IDENTITY_BATCH_2
    args = ["--model-control-mode", "explicit", "--load-model", "identity_fp32"]
    with NaiadProcess(model_repo, *args, f"--load-model-config=identity_fp32={json.dumps(override)}") as proc:
        assert (
            httpclient.InferenceServerClient(proc.http).get_model_config("identity_fp32")["max_batch_size"]
            == 2
        )
    for bad, message in [
        ("identity_fp32={not json", "--load-model-config identity_fp32: not JSON"),
        ("identity_fp32=[1]", "the config must be a JSON object"),
        ("add_sub={}", "--load-model-config add_sub: only for a model --load-model names"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "naiad.cli", "serve", "--model-repository", str(model_repo), *args,
             f"--load-model-config={bad}", "--http-port", "0", "--grpc-port", "0"],
            capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT / "server")),
        )  # fmt: skip
        assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]


def test_load_with_file_override(explicit, model_repo):
    model_py = (model_repo / "identity_fp32" / "1" / "model.py").read_bytes()
    config = {
        "name": "uploaded",
        "backend": "python",
        "max_batch_size": 4,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    }
    body = {
        "parameters": {"config": json.dumps(config), "file:1/model.py": base64.b64encode(model_py).decode()}
    }
    r = requests.post(f"{explicit.url}/v2/repository/models/uploaded/load", json=body)
    assert r.status_code == 200, r.text
    client = httpclient.InferenceServerClient(explicit.http)
    inp = httpclient.InferInput("INPUT0", [1, 2], "FP32")
    inp.set_data_from_numpy(np.array([[5, 6]], dtype=np.float32))
    assert client.infer("uploaded", [inp]).as_numpy("OUTPUT0").tolist() == [[5, 6]]
    bad = {"parameters": {"config": json.dumps(config), "file:../../escape.py": "AAAA"}}
    r = requests.post(f"{explicit.url}/v2/repository/models/uploaded/load", json=bad)
    assert r.status_code == 400 and "escapes" in r.json()["error"]


def test_load_unload_refused_in_mode_none(naiad):
    r = requests.post(f"{naiad.url}/v2/repository/models/add_sub/unload")
    assert r.status_code == 503 and "not allowed" in r.json()["error"]


def test_unload_waits_for_in_flight_requests(explicit):
    client = httpclient.InferenceServerClient(explicit.http)
    client.load_model("slow")
    result = {}

    def slow_call():
        c = httpclient.InferenceServerClient(explicit.http, network_timeout=30)
        inp = httpclient.InferInput("SECONDS", [1], "FP32")
        inp.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        result["out"] = c.infer("slow", [inp]).as_numpy("SECONDS_OUT").tolist()

    t = threading.Thread(target=slow_call)
    t.start()
    time.sleep(0.3)
    client.unload_model("slow")
    t.join(10)
    assert result["out"] == [1.0]
    assert not client.is_model_ready("slow")


def test_poll_mode_picks_up_changes(model_repo, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(model_repo / "identity_fp32", repo / "identity_fp32")
    with NaiadProcess(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.5") as proc:
        client = httpclient.InferenceServerClient(proc.http)
        assert client.is_model_ready("identity_fp32")
        shutil.copytree(model_repo / "add_sub", repo / "add_sub")
        (repo / "identity_fp32" / "2").mkdir()
        shutil.copy(repo / "identity_fp32" / "1" / "model.py", repo / "identity_fp32" / "2" / "model.py")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (
            client.is_model_ready("add_sub") and client.is_model_ready("identity_fp32", "2")
        ):
            time.sleep(0.2)
        assert client.is_model_ready("add_sub")
        assert client.is_model_ready("identity_fp32", "2")
        assert not client.is_model_ready("identity_fp32", "1")  # latest policy: one version
        shutil.rmtree(repo / "add_sub")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and client.is_model_ready("add_sub"):
            time.sleep(0.2)
        assert not client.is_model_ready("add_sub")


def test_strict_readiness_and_failed_model(model_repo):
    with NaiadProcess(model_repo, wait_ready=False) as proc:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "Model" not in proc.output():
            time.sleep(0.2)
        assert requests.get(f"{proc.url}/v2/health/live").status_code == 200
        assert requests.get(f"{proc.url}/v2/health/ready").status_code == 400
        table = proc.output()
        assert "broken_init" in table and "broken on purpose" in table and "| add_sub" in table
        assert requests.get(f"{proc.url}/v2/models/add_sub/ready").status_code == 200


def test_sigterm_drains_in_flight_then_exits_zero(model_repo):
    proc = NaiadProcess(
        model_repo, "--model-control-mode", "explicit", "--load-model", "slow", "--exit-timeout-secs", "10"
    ).start()
    result = {}

    def slow_call():
        c = httpclient.InferenceServerClient(proc.http, network_timeout=30)
        inp = httpclient.InferInput("SECONDS", [1], "FP32")
        inp.set_data_from_numpy(np.array([1.5], dtype=np.float32))
        result["out"] = c.infer("slow", [inp]).as_numpy("SECONDS_OUT").tolist()

    t = threading.Thread(target=slow_call)
    t.start()
    time.sleep(0.4)
    proc.proc.send_signal(signal.SIGTERM)
    t.join(15)
    assert result.get("out") == [1.5]
    assert proc.proc.wait(15) == 0


def test_unloaded_model_keeps_server_ready(explicit):
    """Triton does not count an explicitly unloaded model against (strict) readiness."""
    client = httpclient.InferenceServerClient(explicit.http)
    client.load_model("identity_fp32")
    client.unload_model("identity_fp32")
    assert client.is_server_ready()
