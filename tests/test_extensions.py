"""Triton extensions: system shared memory, logging, trace, restricted APIs, metrics exposition."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from helpers import NaiadProcess
from tritonclient.utils import InferenceServerException


@pytest.fixture()
def regions():
    made = []

    def make(key, size):
        handle = shm.create_shared_memory_region(key.strip("/") + "_h", key, size)
        made.append(handle)
        return handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_system_shared_memory_inference(naiad, regions, proto):
    mod, addr = (httpclient, naiad.http) if proto == "http" else (grpcclient, naiad.grpc)
    client = mod.InferenceServerClient(addr)
    client.unregister_system_shared_memory()
    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 10, dtype=np.float32)
    in_h = regions(f"/naiad_in_{proto}", 32)
    out_h = regions(f"/naiad_out_{proto}", 32)
    shm.set_shared_memory_region(in_h, [a, b])
    client.register_system_shared_memory("in", f"/naiad_in_{proto}", 32)
    client.register_system_shared_memory("out", f"/naiad_out_{proto}", 32)
    status = client.get_system_shared_memory_status()
    names = {r["name"] for r in status} if proto == "http" else set(status.regions)
    assert names == {"in", "out"}
    inputs = [mod.InferInput("INPUT0", [4], "FP32"), mod.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_shared_memory("in", 16)
    inputs[1].set_shared_memory("in", 16, offset=16)
    outputs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("out", 16)
    outputs[1].set_shared_memory("out", 16, offset=16)
    result = client.infer("add_sub", inputs, outputs=outputs)
    assert result.get_output("OUTPUT0") is not None
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_h, np.float32, [4]), a + b)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_h, np.float32, [4], offset=16), a - b)
    client.unregister_system_shared_memory("in")
    client.unregister_system_shared_memory()
    status = client.get_system_shared_memory_status()
    assert (len(status) if proto == "http" else len(status.regions)) == 0


def test_bad_shared_memory_registrations(naiad, regions):
    client = httpclient.InferenceServerClient(naiad.http)
    regions("/naiad_small", 64)
    cases = [
        ("unknown key", "/naiad_no_such_region", 0, 16, "Unable to open"),
        ("path, not a shm key", "/../../etc/passwd", 0, 16, "invalid shared memory key"),
        ("slash inside", "/tmp/x", 0, 16, "invalid shared memory key"),
        ("offset past the end", "/naiad_small", 60, 16, "exceeds the size"),
        ("size overflow", "/naiad_small", 0, 2**63 - 1, "exceeds the size"),
    ]
    for _what, key, offset, size, message in cases:
        with pytest.raises(InferenceServerException, match=message):
            client.register_system_shared_memory("bad", key, size, offset=offset)
    client.register_system_shared_memory("ok", "/naiad_small", 64)
    with pytest.raises(InferenceServerException, match="already in manager"):
        client.register_system_shared_memory("ok", "/naiad_small", 64)
    # an input that reaches past the registered region is rejected, and the server carries on
    inp = httpclient.InferInput("INPUT0", [1, 32], "FP32")
    inp.set_shared_memory("ok", 128)
    with pytest.raises(InferenceServerException, match="past the end"):
        client.infer("identity_fp32", [inp])
    client.unregister_system_shared_memory("ok")
    assert client.is_server_live()


def test_unregister_while_request_uses_region(naiad, regions):
    """The slow model holds the input view for a second while the region is unregistered."""
    client = httpclient.InferenceServerClient(naiad.http, concurrency=2)
    h = regions("/naiad_slow", 4)
    shm.set_shared_memory_region(h, [np.array([0.5], dtype=np.float32)])
    client.register_system_shared_memory("slow_in", "/naiad_slow", 4)
    inp = httpclient.InferInput("SECONDS", [1], "FP32")
    inp.set_shared_memory("slow_in", 4)
    pending = client.async_infer("slow", [inp])
    time.sleep(0.1)
    client.unregister_system_shared_memory("slow_in")
    assert pending.get_result().as_numpy("SECONDS_OUT").tolist() == [0.5]


def test_logging_extension(naiad):
    r = requests.get(f"{naiad.url}/v2/logging")
    assert r.json() == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "default",
    }
    r = requests.post(f"{naiad.url}/v2/logging", json={"log_verbose_level": 1})
    assert r.status_code == 200 and r.json()["log_verbose_level"] == 1
    r = requests.post(f"{naiad.url}/v2/logging", json={"log_verbose_level": "x"})
    assert r.status_code == 400 and "error" in r.json()
    client = grpcclient.InferenceServerClient(naiad.grpc)
    settings = client.get_log_settings(as_json=True)["settings"]
    assert settings["log_verbose_level"]["uint32_param"] == 1
    client.update_log_settings({"log_verbose_level": 0})
    assert requests.get(f"{naiad.url}/v2/logging").json()["log_verbose_level"] == 0


def test_trace_timestamps_written(model_repo, tmp_path):
    trace_file = tmp_path / "trace.json"
    with NaiadProcess(
        model_repo, "--model-control-mode", "explicit", "--load-model", "identity_fp32"
    ) as proc:
        r = requests.get(f"{proc.url}/v2/trace/setting")
        assert r.json() == {
            "trace_level": ["OFF"],
            "trace_rate": "1000",
            "trace_count": "-1",
            "log_frequency": "0",
            "trace_file": "",
            "trace_mode": "triton",
        }
        r = requests.post(
            f"{proc.url}/v2/models/identity_fp32/trace/setting",
            json={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_file": str(trace_file)},
        )
        assert r.status_code == 200 and r.json()["trace_level"] == ["TIMESTAMPS"]
        assert requests.get(f"{proc.url}/v2/models/nope/trace/setting").status_code == 400
        client = httpclient.InferenceServerClient(proc.http)
        for _ in range(3):
            inp = httpclient.InferInput("INPUT0", [1, 2], "FP32")
            inp.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
            client.infer("identity_fp32", [inp])
    entries = json.loads(trace_file.read_text())
    models = [e for e in entries if "model_name" in e]
    stamps = [e for e in entries if "timestamps" in e]
    assert len(models) == 3 and models[0]["model_name"] == "identity_fp32"
    names = [t["name"] for t in stamps[0]["timestamps"]]
    assert names[0] == "REQUEST_START" and names[-1] == "REQUEST_END"
    assert {"QUEUE_START", "COMPUTE_START", "COMPUTE_END"} <= set(names)
    ns = [t["ns"] for t in stamps[0]["timestamps"]]
    assert ns == sorted(ns)


def test_trace_config_triton_file_and_ensemble_parent_id(model_repo, tmp_path):
    """`--trace-config triton,file=...` (Triton's spelling); a traced ensemble's steps carry its id as parent_id."""
    trace_file = tmp_path / "trace.json"
    with NaiadProcess(
        model_repo,
        "--model-control-mode",
        "explicit",
        "--load-model",
        "ensemble_mlp",
        "--trace-config",
        "level=TIMESTAMPS",
        "--trace-config",
        "rate=1",
        "--trace-config",
        f"triton,file={trace_file}",
    ) as proc:
        client = httpclient.InferenceServerClient(proc.http)
        inp = httpclient.InferInput("FEATURES", [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), dtype=np.float32))
        client.infer("ensemble_mlp", [inp])
    models = {e["model_name"]: e for e in json.loads(trace_file.read_text()) if "model_name" in e}
    assert set(models) == {"ensemble_mlp", "mlp_onnx", "scale_python"}
    assert "parent_id" not in models["ensemble_mlp"]
    assert (
        models["mlp_onnx"]["parent_id"] == models["ensemble_mlp"]["id"] == models["scale_python"]["parent_id"]
    )


def test_restricted_apis(model_repo):
    with NaiadProcess(
        model_repo,
        "--model-control-mode",
        "explicit",
        "--load-model",
        "add_sub",
        "--http-restricted-api",
        "model-repository,shared-memory:admin-key=s3cret",
        "--grpc-restricted-protocol",
        "model-repository:admin-key=s3cret",
    ) as proc:
        r = requests.post(f"{proc.url}/v2/repository/index")
        assert r.status_code == 403 and "admin-key" in r.json()["error"]
        r = requests.post(f"{proc.url}/v2/repository/index", headers={"admin-key": "s3cret"})
        assert r.status_code == 200
        assert requests.get(f"{proc.url}/v2/systemsharedmemory/status").status_code == 403
        assert requests.get(f"{proc.url}/v2/models/add_sub").status_code == 200  # not restricted
        client = grpcclient.InferenceServerClient(proc.grpc)
        with pytest.raises(InferenceServerException, match="PERMISSION_DENIED|restricted"):
            client.get_model_repository_index()
        assert client.get_model_repository_index(headers={"admin-key": "s3cret"}).models
        assert client.is_server_ready()


def test_metrics_exposition(naiad, http_client):
    from prometheus_client.parser import text_string_to_metric_families

    inp = httpclient.InferInput("INPUT0", [2, 2], "FP32")
    inp.set_data_from_numpy(np.ones((2, 2), dtype=np.float32))
    http_client.infer("identity_fp32", [inp])
    text = requests.get(f"http://{naiad.metrics}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
    ):
        assert families[name].type == "counter", name
        assert "\n" + name + "{" in text, f"{name} must be exposed without a _total suffix, as Triton does"
    assert families["nv_inference_pending_request_count"].type == "gauge"
    assert families["nv_cpu_utilization"].type == "gauge"
    assert families["nv_cpu_memory_total_bytes"].samples[0].value > 0
    hist = families["nv_inference_request_duration_seconds"]
    assert hist.type == "histogram"
    success = [
        s
        for s in families["nv_inference_request_success"].samples
        if s.labels == {"model": "identity_fp32", "version": "1"}
    ]
    assert success and success[0].value >= 1
