#!/usr/bin/env python3
"""Capture how a real Triton answers the client-compatibility cases of issue 12 (see docs/triton-behaviour.md).

Run with the oracle venv's interpreter (it needs tritonclient + grpcio):

    .venv-triton/bin/python tools/triton/probe_clients.py > out.md
    .venv/bin/python tools/triton/probe_clients.py --naiad > naiad.md   # the same probes against Naiad

Starts one real tritonserver (--model-control-mode=explicit, every model loaded) on the repository that
tests/test_triton_compare.py builds (`client_repo`), and prints markdown: reshape, outputs in system shared
memory (HTTP and gRPC), CUDA shared memory without a GPU, model control errors and ambiguous inputs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from probe import fence, raw_http, section  # noqa: E402  (tools/triton/probe.py)

from tests.client_models import CLIENT_MODELS, build_client_repo  # noqa: E402
from tests.helpers import free_ports  # noqa: E402
from tests.triton_reference import tritonserver  # noqa: E402


def grpc_show(stub, rpc: str, request) -> None:
    import grpc

    try:
        resp = getattr(stub, rpc)(request, timeout=30)
        text = str(resp).strip() or "(empty message)"
        fence(f"> {rpc}\n< OK\n{text}")
    except grpc.RpcError as exc:
        fence(f"> {rpc}\n< {exc.code().name}: {exc.details()}")


def main() -> None:
    repo = build_client_repo(Path(tempfile.mkdtemp(prefix="probe-clients-")) / "models")
    hp, gp, mp = free_ports(3)
    args = ["--model-control-mode=explicit", *[f"--load-model={m}" for m in CLIENT_MODELS]]
    if "--naiad" in sys.argv:
        from tests.helpers import NaiadProcess

        loads = [x for m in CLIENT_MODELS for x in ("--load-model", m)]
        server = NaiadProcess(repo, "--model-control-mode", "explicit", *loads)
        server.http_port, server.grpc_port = hp, gp
        server.start()
        try:
            run(server.grpc, hp)
        finally:
            server.stop()
        return
    with tritonserver(repo, hp, gp, mp, args, timeout=120) as t:
        run(t.grpc_url, hp)


def run(grpc_url: str, hp: int) -> None:
    """Every probe, against the server whose HTTP port is `hp`."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_url))

    def post(path, body, headers=None, title=None):
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        return raw_http("POST", path, body, headers, port=hp, title=title)

    section("reshape", 3)
    raw_http("GET", "/v2/models/reshape_py/config", port=hp)
    raw_http("GET", "/v2/models/reshape_py", port=hp)
    x = list(range(24))
    post(
        "/v2/models/reshape_py/infer",
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 12], "data": x}]},
    )
    post(
        "/v2/models/reshape_py/infer",
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 11], "data": x[:22]}]},
    )
    post(
        "/v2/models/reshape_nobatch/infer",
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [12], "data": x[:12]}]},
    )

    section("Outputs in system shared memory", 3)
    fd = os.open("/dev/shm/probe_out", os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    try:
        post(
            "/v2/systemsharedmemory/region/out/register",
            {"key": "/probe_out", "offset": 0, "byte_size": 4096},
        )
        shm_params = {"shared_memory_region": "out", "shared_memory_byte_size": 64}
        body = {
            "inputs": [
                {"name": "INPUT0", "datatype": "FP32", "shape": [16], "data": [1.0] * 16},
                {"name": "INPUT1", "datatype": "FP32", "shape": [16], "data": [1.0] * 16},
            ],
            "outputs": [
                {"name": "OUTPUT0", "parameters": shm_params},
                {"name": "OUTPUT1", "parameters": {**shm_params, "shared_memory_offset": 64}},
            ],
        }
        post("/v2/models/add_sub/infer", body, title="Both outputs in shared memory (HTTP):")
        body["outputs"][1] = {"name": "OUTPUT1", "parameters": {"binary_data": False}}
        post("/v2/models/add_sub/infer", body, title="OUTPUT0 in shared memory, OUTPUT1 as JSON:")
        req = pb.ModelInferRequest(model_name="add_sub")
        for name in ("INPUT0", "INPUT1"):
            i = req.inputs.add(name=name, datatype="FP32", shape=[16])
            i.contents.fp32_contents.extend([1.0] * 16)
        o = req.outputs.add(name="OUTPUT0")
        o.parameters["shared_memory_region"].string_param = "out"
        o.parameters["shared_memory_byte_size"].int64_param = 64
        req.outputs.add(name="OUTPUT1")
        resp = stub.ModelInfer(req)
        fence(
            "gRPC, OUTPUT0 in shared memory, OUTPUT1 not:\n"
            f"raw_output_contents = {[bytes(r)[:8] + (b'...' if len(r) > 8 else b'') for r in resp.raw_output_contents]}\n"
            + str(resp)
        )
        req.outputs[1].parameters["shared_memory_region"].string_param = "out"
        req.outputs[1].parameters["shared_memory_byte_size"].int64_param = 64
        req.outputs[1].parameters["shared_memory_offset"].int64_param = 64
        resp = stub.ModelInfer(req)
        fence(
            f"gRPC, both in shared memory:\nraw_output_contents = {list(resp.raw_output_contents)}\n"
            + str(resp)
        )
        section("Input with both data and a shared-memory region", 4)
        post(
            "/v2/models/identity_fp32/infer",
            {
                "inputs": [
                    {
                        "name": "INPUT0",
                        "datatype": "FP32",
                        "shape": [1, 4],
                        "data": [1, 2, 3, 4],
                        "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 16},
                    }
                ]
            },
        )
        req = pb.ModelInferRequest(model_name="identity_fp32")
        i = req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
        i.contents.fp32_contents.extend([1, 2, 3, 4])
        i.parameters["shared_memory_region"].string_param = "out"
        i.parameters["shared_memory_byte_size"].int64_param = 16
        grpc_show(stub, "ModelInfer", req)
        post("/v2/systemsharedmemory/unregister", b"")
    finally:
        os.unlink("/dev/shm/probe_out")

    section("CUDA shared memory without a GPU", 3)
    raw_http("GET", "/v2/cudasharedmemory/status", port=hp)
    raw_http("GET", "/v2/cudasharedmemory/region/nope/status", port=hp)
    post("/v2/cudasharedmemory/unregister", b"")
    post("/v2/cudasharedmemory/region/nope/unregister", b"")
    post(
        "/v2/cudasharedmemory/region/r/register",
        {"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 16},
    )
    grpc_show(stub, "CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest())
    grpc_show(stub, "CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest(name="nope"))
    grpc_show(stub, "CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest())
    grpc_show(stub, "CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest(name="nope"))

    section("Model control errors", 3)
    post("/v2/repository/models/identity_fp32/load", {"parameters": {"config": "{not json"}})
    req = pb.RepositoryModelLoadRequest(model_name="identity_fp32")
    req.parameters["config"].string_param = "{not json"
    grpc_show(stub, "RepositoryModelLoad", req)
    long_name = "file:1/" + "x" * 300 + ".py"
    post("/v2/repository/models/fresh/load", {"parameters": {"config": "{}", long_name: "AAAA"}})
    req = pb.RepositoryModelLoadRequest(model_name="fresh")
    req.parameters["config"].string_param = "{}"
    req.parameters[long_name].bytes_param = b"\0\0\0"
    grpc_show(stub, "RepositoryModelLoad", req)
    post("/v2/repository/models/nope/load", b"")
    post("/v2/repository/index", b"", title="Index after loading 'nope' (no such model):")
    post("/v2/repository/models/ens_identity/unload", {"parameters": {"unload_dependents": True}})
    import time

    time.sleep(2)
    post(
        "/v2/repository/index",
        {"ready": True},
        title="Ready models after unloading the ensemble with unload_dependents:",
    )
    for m in CLIENT_MODELS:
        post(f"/v2/repository/models/{m}/load", b"", title=None) if m != "identity_fp32" else None

    section("Ambiguous inputs and request ids", 3)
    one = {"name": "INPUT0", "datatype": "FP32", "shape": [1, 4]}
    head = json.dumps(
        {"inputs": [{**one, "data": [1, 2, 3, 4], "parameters": {"binary_data_size": 16}}]}
    ).encode()
    post(
        "/v2/models/identity_fp32/infer",
        head + np.arange(4, dtype=np.float32).tobytes(),
        {"Inference-Header-Content-Length": str(len(head))},
    )
    req = pb.ModelInferRequest(model_name="identity_fp32")
    i = req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    i.contents.fp32_contents.extend([1, 2, 3, 4])
    req.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    grpc_show(stub, "ModelInfer", req)
    for rid in (5, {"a": 1}, None, ["x"]):
        post("/v2/models/identity_fp32/infer", {"id": rid, "inputs": [{**one, "data": [1, 2, 3, 4]}]})
    big = [0, 1, 2**63, 2**64 - 1]
    post(
        "/v2/models/identity_u64/infer",
        {"inputs": [{"name": "INPUT0", "datatype": "UINT64", "shape": [1, 4], "data": big}]},
    )
    post(
        "/v2/models/identity_u64/infer",
        {"inputs": [{"name": "INPUT0", "datatype": "UINT64", "shape": [1, 1], "data": [2**64]}]},
    )
    post(
        "/v2/models/identity_u64/infer",
        {"inputs": [{"name": "INPUT0", "datatype": "UINT64", "shape": [1, 1], "data": [-1]}]},
    )


if __name__ == "__main__":
    main()
