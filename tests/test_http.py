"""HTTP/REST frontend through tritonclient.http and raw requests, against a live server."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

ALL_TYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "STRING": np.object_,
}


def sample(dtype, n=5):
    if dtype is np.object_:
        return np.array([f"s{i}".encode() for i in range(n)], dtype=np.object_)
    if dtype is np.bool_:
        return np.array([i % 2 == 0 for i in range(n)])
    return (np.arange(n) + 1).astype(dtype)


def test_health_and_metadata(naiad, http_client):
    assert http_client.is_server_live()
    assert http_client.is_server_ready()
    md = http_client.get_server_metadata()
    assert md["name"] == "naiad"
    for ext in ("model_repository", "binary_tensor_data", "statistics", "classification"):
        assert ext in md["extensions"]


def test_model_metadata_and_config(http_client):
    md = http_client.get_model_metadata("identity_fp32")
    assert md == {
        "name": "identity_fp32",
        "versions": ["1"],
        "platform": "python",
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, -1]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, -1]}],
    }
    assert http_client.get_model_metadata("identity_fp32", "1")["name"] == "identity_fp32"
    cfg = http_client.get_model_config("add_sub")
    assert cfg["name"] == "add_sub" and cfg["backend"] == "python"
    assert cfg["input"][0]["dims"] == [4]  # int64 rendered as numbers, like Triton
    assert cfg["instance_group"][0]["count"] == 2
    assert cfg["version_policy"] == {"latest": {"num_versions": 1}}
    assert http_client.is_model_ready("add_sub") and http_client.is_model_ready("add_sub", "1")
    assert not http_client.is_model_ready("add_sub", "7")
    assert not http_client.is_model_ready("broken_init")


def test_onnx_auto_complete(http_client):
    cfg = http_client.get_model_config("mlp_onnx_auto")
    assert cfg["max_batch_size"] == 4
    assert cfg["input"][0]["name"] == "input" and cfg["input"][0]["dims"] == [16]
    assert cfg["output"][0]["dims"] == [8]
    assert "dynamic_batching" in cfg
    fixed = http_client.get_model_config("mlp_onnx_fixed")
    assert fixed["max_batch_size"] == 0 and fixed["input"][0]["dims"] == [1, 16]


@pytest.mark.parametrize("binary", [False, True])
def test_infer_add_sub(http_client, binary):
    a = np.arange(4, dtype=np.float32)
    b = np.ones(4, dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
        httpclient.InferRequestedOutput("OUTPUT1", binary_data=not binary),
    ]
    result = http_client.infer("add_sub", inputs, outputs=outputs, request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.get_response()["id"] == "req-7"


@pytest.mark.parametrize("binary", [False, True])
def test_every_datatype_roundtrips(http_client, binary):
    inputs, outputs = [], []
    for name, dtype in ALL_TYPES.items():
        data = sample(dtype)
        inp = httpclient.InferInput(
            f"IN_{name}",
            list(data.shape),
            np_to_triton_dtype(data.dtype) if dtype is not np.object_ else "BYTES",
        )
        inp.set_data_from_numpy(data, binary_data=binary or name == "FP16")
        inputs.append(inp)
        outputs.append(httpclient.InferRequestedOutput(f"OUT_{name}", binary_data=binary or name == "FP16"))
    result = http_client.infer("identity_all", inputs, outputs=outputs)
    for name, dtype in ALL_TYPES.items():
        got = result.as_numpy(f"OUT_{name}")
        if dtype is np.object_ and not binary:  # tritonclient returns JSON strings as str
            got = np.array([s.encode() for s in got], dtype=np.object_)
        np.testing.assert_array_equal(got, sample(dtype))
        if dtype is not np.object_:
            assert got.dtype == np.dtype(dtype)


def test_bf16_binary_roundtrip(naiad):
    words = np.array([0x3F80, 0x4000, 0xC040], dtype=np.uint16)  # 1.0, 2.0, -3.0 in bfloat16
    header = json.dumps(
        {
            "inputs": [
                {"name": "IN_BF16", "shape": [3], "datatype": "BF16", "parameters": {"binary_data_size": 6}}
            ],
            "outputs": [{"name": "OUT_BF16", "parameters": {"binary_data": True}}],
        }
    ).encode()
    r = requests.post(
        f"{naiad.url}/v2/models/identity_all/infer",
        data=header + words.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    doc = json.loads(r.content[:n])
    assert doc["outputs"][0]["datatype"] == "BF16"
    assert np.frombuffer(r.content[n:], dtype=np.uint16).tolist() == words.tolist()


def test_nested_json_data_as_in_the_tutorial(naiad):
    body = {
        "inputs": [{"name": "INPUT0", "shape": [2, 3], "datatype": "FP32", "data": [[1, 2, 3], [4, 5, 6]]}]
    }
    r = requests.post(f"{naiad.url}/v2/models/identity_fp32/versions/1/infer", json=body)
    assert r.status_code == 200
    out = r.json()["outputs"][0]
    assert out["shape"] == [2, 3] and out["data"] == [1, 2, 3, 4, 5, 6] and out["datatype"] == "FP32"
    assert r.json()["model_version"] == "1"


def test_binary_data_output_parameter_and_gzip(naiad):
    body = json.dumps(
        {
            "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    r = requests.post(
        f"{naiad.url}/v2/models/identity_fp32/infer",
        data=gzip.compress(body),
        headers={"Content-Encoding": "gzip"},
    )
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    assert json.loads(r.content[:n])["outputs"][0]["parameters"] == {"binary_data_size": 16}
    assert np.frombuffer(r.content[n:], dtype=np.float32).tolist() == [1, 2, 3, 4]


def test_torchscript_model(http_client):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 2, dtype=np.float32)
    inputs = [
        httpclient.InferInput("INPUT__0", [2, 3], "FP32"),
        httpclient.InferInput("INPUT__1", [2, 3], "FP32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = http_client.infer("add_pt", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), a * b)


def test_onnx_model_matches_onnxruntime(http_client, model_repo):
    import onnxruntime as ort

    x = np.random.default_rng(1).random((3, 16), dtype=np.float32)
    inp = httpclient.InferInput("input", [3, 16], "FP32")
    inp.set_data_from_numpy(x)
    got = http_client.infer("mlp_onnx", [inp]).as_numpy("output")
    sess = ort.InferenceSession(str(model_repo / "mlp_onnx" / "1" / "model.onnx"))
    np.testing.assert_allclose(got, sess.run(None, {"input": x})[0], rtol=1e-6)


def test_bls_sync_and_async(http_client):
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.full(4, 7, dtype=np.float32))
    np.testing.assert_array_equal(http_client.infer("bls_add_sub", inputs).as_numpy("OUTPUT0"), 2 * a)


def test_bls_error_is_reported(http_client):
    inp = httpclient.InferInput("INPUT0", [4], "FP32")
    inp.set_data_from_numpy(np.zeros(4, dtype=np.float32))
    with pytest.raises(InferenceServerException, match="BLS failed:.*no_such_model"):
        http_client.infer("bls_missing", [inp])


def test_ensemble_onnx_then_python(http_client, model_repo):
    import onnxruntime as ort

    x = np.random.default_rng(2).random((2, 16), dtype=np.float32)
    inp = httpclient.InferInput("FEATURES", [2, 16], "FP32")
    inp.set_data_from_numpy(x)
    result = http_client.infer("ensemble_mlp", [inp])
    logits = ort.InferenceSession(str(model_repo / "mlp_onnx" / "1" / "model.onnx")).run(None, {"input": x})[
        0
    ]
    np.testing.assert_allclose(result.as_numpy("LOGITS"), logits, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("DOUBLED"), 2 * logits, rtol=1e-6)


def test_classification_extension(http_client):
    inp = httpclient.InferInput("INPUT0", [2, 4], "FP32")
    inp.set_data_from_numpy(np.array([[0.1, 0.7, 0.15, 0.05], [0.5, 0.1, 0.2, 0.2]], dtype=np.float32))
    out = httpclient.InferRequestedOutput("OUTPUT0", class_count=2)
    got = http_client.infer("scores", [inp], outputs=[out]).as_numpy("OUTPUT0")
    assert got.shape == (2, 2)
    assert got[0, 0].decode().endswith(":1:dog") and got[1, 0].decode().endswith(":0:cat")


# ---- errors: status code and a JSON {"error": ...} body, and the server keeps serving ----


def post(naiad, path, **kw):
    return requests.post(f"{naiad.url}{path}", timeout=10, **kw)


def fp32(name, shape, data=None):
    return {
        "name": name,
        "shape": shape,
        "datatype": "FP32",
        "data": data if data is not None else [0.0] * int(np.prod(shape)),
    }


@pytest.mark.parametrize(
    "path,body,status,message",
    [
        ("/v2/models/nope/infer", {"inputs": [fp32("INPUT0", [1, 1])]}, 404, "unknown model"),
        ("/v2/models/identity_fp32/versions/9/infer", {"inputs": [fp32("INPUT0", [1, 1])]}, 404, "version 9"),
        ("/v2/models/identity_fp32/versions/x/infer", {"inputs": [fp32("INPUT0", [1, 1])]}, 404, "Not Found"),
        (
            "/v2/models/identity_fp32/infer",
            {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "INT32", "data": [1]}]},
            400,
            "data-type",
        ),
        (
            "/v2/models/add_sub/infer",
            {"inputs": [fp32("INPUT0", [5]), fp32("INPUT1", [4])]},
            400,
            "unexpected shape",
        ),
        ("/v2/models/add_sub/infer", {"inputs": [fp32("INPUT0", [4])]}, 400, "missing required input"),
        (
            "/v2/models/add_sub/infer",
            {"inputs": [fp32("INPUT0", [4]), fp32("INPUT1", [4]), fp32("EXTRA", [4])]},
            400,
            "unexpected inference input 'EXTRA'",
        ),
        (
            "/v2/models/identity_fp32/infer",
            {"inputs": [fp32("INPUT0", [9, 1])]},
            400,
            "batch-size must be <= 8",
        ),
        (
            "/v2/models/identity_fp32/infer",
            {"inputs": [fp32("INPUT0", [2, 2], [1, 2, 3])]},
            400,
            "number of elements",
        ),
        (
            "/v2/models/add_sub/infer",
            {"inputs": [fp32("INPUT0", [4]), fp32("INPUT1", [4])], "outputs": [{"name": "NOPE"}]},
            400,
            "unexpected inference output",
        ),
        (
            "/v2/models/identity_fp32/infer",
            {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP99", "data": [1]}]},
            400,
            "datatype",
        ),
        (
            "/v2/models/identity_fp32/infer",
            {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": ["abc"]}]},
            400,
            "parse",
        ),
        (
            "/v2/models/identity_fp32/infer",
            {"inputs": [fp32("INPUT0", [1, 1])], "outputs": [{"name": "OUTPUT0", "parameters": [1]}]},
            400,
            "output 'OUTPUT0': 'parameters' must be a JSON object",
        ),
        ("/v2/models/broken_init/infer", {"inputs": [fp32("INPUT0", [1])]}, 404, "has no available versions"),
    ],
)
def test_bad_requests(naiad, path, body, status, message):
    r = post(naiad, path, json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]


def test_malformed_json(naiad):
    r = post(naiad, "/v2/models/identity_fp32/infer", data=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]


def test_binary_header_length_mismatch(naiad):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 16},
                }
            ]
        }
    ).encode()
    r = post(
        naiad,
        "/v2/models/identity_fp32/infer",
        data=header + b"\0" * 16,
        headers={"Inference-Header-Content-Length": str(len(header) + 100)},
    )
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"]
    r = post(
        naiad,
        "/v2/models/identity_fp32/infer",
        data=header + b"\0" * 8,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 400 and "binary data" in r.json()["error"]


def test_server_still_serves_after_bad_input(http_client):
    inp = httpclient.InferInput("INPUT0", [1, 2], "FP32")
    inp.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    assert http_client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0").tolist() == [[1, 1]]


def test_statistics(http_client):
    inp = httpclient.InferInput("INPUT0", [3, 2], "FP32")
    inp.set_data_from_numpy(np.ones((3, 2), dtype=np.float32))
    before = http_client.get_inference_statistics("identity_fp32")["model_stats"][0]
    http_client.infer("identity_fp32", [inp])
    after = http_client.get_inference_statistics("identity_fp32", "1")["model_stats"][0]
    assert after["name"] == "identity_fp32" and after["version"] == "1"
    assert after["inference_count"] - before["inference_count"] == 3
    assert after["execution_count"] - before["execution_count"] == 1
    stats = after["inference_stats"]
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert set(stats[key]) == {"count", "ns"}
    assert stats["success"]["count"] >= 1 and stats["success"]["ns"] > 0
    assert any(b["batch_size"] == 3 for b in after["batch_stats"])
    everything = http_client.get_inference_statistics()["model_stats"]
    assert {"identity_fp32", "add_sub"} <= {s["name"] for s in everything}
