"""Real Triton clients against a live `naiad serve`: reshape, outputs in system shared memory, CUDA shared memory
without a GPU, model control errors and ambiguous inputs, each answered as Triton 2.51 answers (see
docs/triton-behaviour.md, "Client compatibility")."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from build_models import build_reshape_onnx
from client_models import CLIENT_MODELS, build_client_repo
from helpers import NaiadProcess
from tritonclient.utils import InferenceServerException

HEADER_LENGTH = "Inference-Header-Content-Length"
WARMUP = """
model_warmup [ { name: "zeros" batch_size: 2 count: 1
  inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 12 ] zero_data: true } } } ]
"""
ONLY_ONE = (
    "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
    "'shared_memory_region' in 'parameters'. But set "
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = build_client_repo(tmp_path_factory.mktemp("clients") / "models")
    onnx_dir = build_reshape_onnx(repo)
    # The same model warmed up at load: warmup samples are given in `dims` and reshaped like requests.
    shutil.copytree(onnx_dir, repo / "reshape_onnx_warm")
    config = (onnx_dir / "config.pbtxt").read_text().replace('"reshape_onnx"', '"reshape_onnx_warm"')
    (repo / "reshape_onnx_warm" / "config.pbtxt").write_text(config + WARMUP)
    models = (*CLIENT_MODELS, "reshape_onnx", "reshape_onnx_warm")
    loads = [x for m in models for x in ("--load-model", m)]
    with NaiadProcess(repo, "--model-control-mode", "explicit", *loads) as proc:
        yield proc


@pytest.fixture(scope="module")
def http_client(server):
    client = httpclient.InferenceServerClient(server.http)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    yield client
    client.close()


def _infer(
    client, module, model: str, inputs: dict[str, np.ndarray], datatypes: dict[str, str] | None = None
):
    tensors = []
    for name, arr in inputs.items():
        dt = (datatypes or {}).get(name, "FP32")
        t = module.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    return client.infer(model, tensors)


# ---- 1. reshape -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_reshape_python_model_sees_reshaped_dims_client_sees_dims(http_client, grpc_client, protocol):
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    x = np.arange(24, dtype=np.float32).reshape(2, 12)
    result = _infer(client, module, "reshape_py", {"INPUT0": x})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)  # back in the configured dims [12]
    np.testing.assert_array_equal(result.as_numpy("SEEN"), [[2, 3, 4], [2, 3, 4]])  # batch kept, [3, 4]
    result = _infer(client, module, "reshape_nobatch", {"INPUT0": x[0]})
    assert result.as_numpy("OUTPUT0").shape == (12,)
    np.testing.assert_array_equal(result.as_numpy("SEEN"), [3, 4])


@pytest.mark.parametrize("model", ["reshape_onnx", "reshape_onnx_warm"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_reshape_onnx_model_of_rank_three(http_client, grpc_client, protocol, model):
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    x = np.arange(36, dtype=np.float32).reshape(3, 12)
    out = _infer(client, module, model, {"input": x}).as_numpy("output")
    expected = (x.reshape(3, 3, 4) * 2 + np.arange(3, dtype=np.float32).reshape(1, 3, 1)).reshape(3, 12)
    assert out.shape == (3, 12)
    np.testing.assert_array_equal(out, expected)


def test_reshape_input_is_validated_against_dims_not_reshape(server):
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3, 4], "data": list(range(12))}]}
    r = requests.post(f"{server.url}/v2/models/reshape_py/infer", json=body, timeout=30)
    assert r.status_code == 400
    assert "Expected [-1,12], got [1,3,4]" in r.json()["error"]


# ---- 2. outputs in system shared memory -----------------------------------------------------------------


@pytest.fixture
def region(server):
    handle = shm.create_shared_memory_region("out", "/naiad_parity_out", 128)
    requests.post(
        f"{server.url}/v2/systemsharedmemory/region/out/register",
        json={"key": "/naiad_parity_out", "offset": 0, "byte_size": 128},
        timeout=10,
    ).raise_for_status()
    yield handle
    requests.post(f"{server.url}/v2/systemsharedmemory/unregister", timeout=10)
    shm.destroy_shared_memory_region(handle)


def _add_sub_body(outputs: list[dict]) -> dict:
    ones = {"datatype": "FP32", "shape": [16], "data": [1.0] * 16}
    return {"inputs": [{"name": "INPUT0", **ones}, {"name": "INPUT1", **ones}], "outputs": outputs}


def test_http_output_in_shared_memory_has_no_parameters(server, region):
    params = {"shared_memory_region": "out", "shared_memory_byte_size": 64}
    body = _add_sub_body(
        [{"name": "OUTPUT0", "parameters": params}, {"name": "OUTPUT1", "parameters": {"binary_data": False}}]
    )
    r = requests.post(f"{server.url}/v2/models/add_sub/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"] == [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": [16]},
        {"name": "OUTPUT1", "datatype": "FP32", "shape": [16], "data": [0.0] * 16},
    ]
    np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.float32, [16]), np.full(16, 2.0))


def test_grpc_sends_one_empty_raw_entry_per_output_in_shared_memory(server, region):
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    req = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[16]).contents.fp32_contents.extend([3.0] * 16)
    o = req.outputs.add(name="OUTPUT0")
    o.parameters["shared_memory_region"].string_param = "out"
    o.parameters["shared_memory_byte_size"].int64_param = 64
    req.outputs.add(name="OUTPUT1")
    with grpc.insecure_channel(server.grpc) as channel:
        resp = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    assert [bytes(r) for r in resp.raw_output_contents] == [b"", np.zeros(16, np.float32).tobytes()]
    assert not resp.outputs[0].parameters
    np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.float32, [16]), np.full(16, 6.0))


# ---- 3. CUDA shared memory without a GPU ----------------------------------------------------------------


def test_cuda_shared_memory_cleanup_calls_succeed(http_client, grpc_client):
    """tritonclient's system-shm examples call these during clean-up; with nothing registered they succeed."""
    http_client.unregister_cuda_shared_memory()
    http_client.unregister_cuda_shared_memory("never_registered")
    assert http_client.get_cuda_shared_memory_status() == []
    grpc_client.unregister_cuda_shared_memory()
    assert not grpc_client.get_cuda_shared_memory_status().regions


# ---- 4. model control errors ----------------------------------------------------------------------------


def _index(server) -> dict[str, str]:
    entries = requests.post(f"{server.url}/v2/repository/index", json={}, timeout=10).json()
    return {e["name"]: e.get("state", "") for e in entries}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_load_with_invalid_json_config_says_failed_to_load(http_client, grpc_client, protocol):
    client = http_client if protocol == "http" else grpc_client
    with pytest.raises(InferenceServerException) as err:
        client.load_model("identity_fp32", config="{not json")
    assert err.value.message().startswith("failed to load 'identity_fp32', ")
    assert client.is_model_ready("identity_fp32")  # the loaded version keeps serving


def test_file_override_with_a_name_too_long_is_a_clear_400(server):
    name = "file:1/" + "x" * 300 + ".py"
    body = {"parameters": {"config": json.dumps({"backend": "python"}), name: "AAAA"}}
    r = requests.post(f"{server.url}/v2/repository/models/fresh/load", json=body, timeout=30)
    assert r.status_code == 400
    message = r.json()["error"]
    assert message.startswith("failed to load 'fresh', ") and name in message and "too long" in message
    assert "/tmp/" not in message  # names the client's file, not the server's scratch directory
    assert "fresh" not in _index(server)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_load_of_a_name_in_no_repository_leaves_no_index_entry(server, http_client, grpc_client, protocol):
    client = http_client if protocol == "http" else grpc_client
    with pytest.raises(InferenceServerException) as err:
        client.load_model("no_such_model")
    assert "failed to load 'no_such_model'" in err.value.message()
    assert "no_such_model" not in _index(server)


def test_unload_dependents_unloads_the_composing_models_the_ensemble_brought(http_client):
    http_client.load_model("ens_dep")  # brings identity_dep in as its composing model
    assert http_client.is_model_ready("identity_dep")
    http_client.unload_model("ens_dep", unload_dependents=True)
    _wait_not_ready(http_client, "identity_dep")
    assert not http_client.is_model_ready("ens_dep")
    # A composing model loaded by its own name (--load-model) stays, as on Triton.
    http_client.unload_model("ens_identity", unload_dependents=True)
    _wait_not_ready(http_client, "ens_identity")
    assert http_client.is_model_ready("identity_fp32")
    http_client.load_model("ens_identity")
    # Without unload_dependents the composing model stays.
    http_client.load_model("ens_dep")
    http_client.unload_model("ens_dep")
    _wait_not_ready(http_client, "ens_dep")
    assert http_client.is_model_ready("identity_dep")


def _wait_not_ready(client, model: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while client.is_model_ready(model):
        assert time.monotonic() < deadline, f"{model} still ready"
        time.sleep(0.1)


# ---- 5. ambiguous inputs, request ids, UINT64 -----------------------------------------------------------


def test_http_input_with_data_and_binary_data_size_is_rejected(server):
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "FP32",
                    "shape": [1, 4],
                    "data": [1, 2, 3, 4],
                    "parameters": {"binary_data_size": 16},
                }
            ]
        }
    ).encode()
    r = requests.post(
        f"{server.url}/v2/models/identity_fp32/infer",
        data=head + np.arange(4, dtype=np.float32).tobytes(),
        headers={HEADER_LENGTH: str(len(head))},
        timeout=30,
    )
    assert (r.status_code, r.json()["error"]) == (400, ONLY_ONE + "'data' 'binary_data_size'")


def test_input_with_data_and_shared_memory_is_rejected(server, region):
    params = {"shared_memory_region": "out", "shared_memory_byte_size": 16}
    one = {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4], "parameters": params}
    r = requests.post(f"{server.url}/v2/models/identity_fp32/infer", json={"inputs": [one]}, timeout=30)
    assert (r.status_code, r.json()["error"]) == (400, ONLY_ONE + "'data' 'shared_memory_region'")
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    req = pb.ModelInferRequest(model_name="identity_fp32")
    i = req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    i.contents.fp32_contents.extend([1, 2, 3, 4])
    i.parameters["shared_memory_region"].string_param = "out"
    i.parameters["shared_memory_byte_size"].int64_param = 16
    with grpc.insecure_channel(server.grpc) as channel, pytest.raises(grpc.RpcError) as err:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "unexpected 'content' provided when using shared memory for input tensor 'INPUT0' for model "
        "'identity_fp32'"
    )


def test_grpc_input_with_contents_and_raw_input_contents_is_rejected(server):
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    req = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[16]).contents.fp32_contents.extend([1.0] * 16)
        req.raw_input_contents.append(np.ones(16, np.float32).tobytes())
    with grpc.insecure_channel(server.grpc) as channel, pytest.raises(grpc.RpcError) as err:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'add_sub'"
    )


@pytest.mark.parametrize("request_id", [5, 1.5, None, True, {"a": 1}, ["x"]], ids=repr)
def test_request_id_that_is_not_a_string_is_a_400(server, request_id):
    body = {
        "id": request_id,
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [1]}],
    }
    r = requests.post(f"{server.url}/v2/models/identity_fp32/infer", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json() == {"error": "Unable to parse 'id': attempt to access JSON non-string as string"}


def test_uint64_round_trips_through_json_up_to_its_maximum(server, http_client, grpc_client):
    values = [0, 1, 2**53 + 1, 2**63, 2**64 - 1]
    body = {"inputs": [{"name": "INPUT0", "datatype": "UINT64", "shape": [1, 5], "data": values}]}
    r = requests.post(f"{server.url}/v2/models/identity_u64/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert b"18446744073709551615" in r.content
    assert r.json()["outputs"][0]["data"] == values
    for bad in ([2**64], [-1]):
        body["inputs"][0].update(shape=[1, 1], data=bad)
        r = requests.post(f"{server.url}/v2/models/identity_u64/infer", json=body, timeout=30)
        assert r.status_code == 400, r.text
    x = np.array([values], dtype=np.uint64)
    for client, module in ((http_client, httpclient), (grpc_client, grpcclient)):
        out = _infer(client, module, "identity_u64", {"INPUT0": x}, {"INPUT0": "UINT64"}).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_mixing_shared_memory_and_tensor_data(server, http_client, grpc_client, protocol):
    """tritonclient puts one raw entry per input NOT in shared memory; the server pairs them up in order."""
    client, module = (http_client, httpclient) if protocol == "http" else (grpc_client, grpcclient)
    handle = shm.create_shared_memory_region("in0", f"/naiad_parity_in0_{protocol}", 64)
    try:
        shm.set_shared_memory_region(handle, [np.full(16, 2.0, np.float32)])
        client.register_system_shared_memory("in0", f"/naiad_parity_in0_{protocol}", 64)
        in0 = module.InferInput("INPUT0", [16], "FP32")
        in0.set_shared_memory("in0", 64)
        in1 = module.InferInput("INPUT1", [16], "FP32")
        in1.set_data_from_numpy(np.arange(16, dtype=np.float32))
        result = client.infer("add_sub", [in0, in1])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2.0 + np.arange(16, dtype=np.float32))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 2.0 - np.arange(16, dtype=np.float32))
    finally:
        client.unregister_system_shared_memory("in0")
        shm.destroy_shared_memory_region(handle)
