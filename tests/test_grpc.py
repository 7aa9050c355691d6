"""gRPC frontend through tritonclient.grpc and tritonclient.grpc.aio, against a live server."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from test_http import ALL_TYPES, sample
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException


def test_health_metadata_config(grpc_client):
    assert grpc_client.is_server_live() and grpc_client.is_server_ready()
    md = grpc_client.get_server_metadata()
    assert md.name == "naiad" and "model_repository" in md.extensions
    mmd = grpc_client.get_model_metadata("identity_fp32")
    assert mmd.name == "identity_fp32" and list(mmd.versions) == ["1"] and mmd.platform == "python"
    assert mmd.inputs[0].datatype == "FP32" and list(mmd.inputs[0].shape) == [-1, -1]
    cfg = grpc_client.get_model_config("add_sub").config
    assert cfg.name == "add_sub" and cfg.instance_group[0].count == 2 and list(cfg.input[0].dims) == [4]
    assert grpc_client.is_model_ready("add_sub")
    assert not grpc_client.is_model_ready("broken_init")
    assert not grpc_client.is_model_ready("nope")  # Triton answers OK with ready=false


def test_grpc_health_service(naiad):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(naiad.grpc) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_every_datatype_roundtrips(grpc_client):
    inputs, outputs = [], []
    for name, dtype in ALL_TYPES.items():
        data = sample(dtype)
        inp = grpcclient.InferInput(
            f"IN_{name}",
            list(data.shape),
            "BYTES"
            if dtype is np.object_
            else {np.bool_: "BOOL"}.get(dtype, np.dtype(dtype).name.upper().replace("FLOAT", "FP")),
        )
        inp.set_data_from_numpy(data)
        inputs.append(inp)
        outputs.append(grpcclient.InferRequestedOutput(f"OUT_{name}"))
    result = grpc_client.infer("identity_all", inputs, outputs=outputs)
    for name, dtype in ALL_TYPES.items():
        got = result.as_numpy(f"OUT_{name}")
        np.testing.assert_array_equal(got, sample(dtype))


def test_typed_contents_without_raw(naiad):
    """A hand-built request using InferTensorContents instead of raw_input_contents."""
    with grpc.insecure_channel(naiad.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="add_sub", id="typed")
        for name, values in (("INPUT0", [1, 2, 3, 4]), ("INPUT1", [1, 1, 1, 1])):
            t = req.inputs.add(name=name, datatype="FP32", shape=[4])
            t.contents.fp32_contents.extend(values)
        resp = stub.ModelInfer(req)
        assert resp.id == "typed" and resp.model_name == "add_sub"
        by_name = {o.name: i for i, o in enumerate(resp.outputs)}
        assert np.frombuffer(resp.raw_output_contents[by_name["OUTPUT0"]], np.float32).tolist() == [
            2,
            3,
            4,
            5,
        ]


def test_large_typed_contents_byte_for_byte(naiad):
    """Large typed contents (read from their packed wire form, grpc/codec.py's _typed_array) come back
    exactly, next to a small one and integer ones (protobuf's list)."""
    rng = np.random.default_rng(7)
    data = {
        "FP32": (rng.random(300_000, dtype=np.float32), "fp32_contents"),
        "FP64": (rng.random(70_000), "fp64_contents"),
        "BOOL": (rng.random(100_000) > 0.5, "bool_contents"),
        "INT32": (rng.integers(-(2**31), 2**31, 5_000, dtype=np.int32), "int_contents"),
        "UINT8": (np.arange(10, dtype=np.uint8), "uint_contents"),
        # every integer datatype over its whole range (protobuf's list read as its C values, narrowed)
        "INT8": (np.array([-128, -1, 0, 1, 127], dtype=np.int8), "int_contents"),
        "INT16": (np.array([-(2**15), -1, 0, 2**15 - 1], dtype=np.int16), "int_contents"),
        "UINT16": (np.array([0, 1, 2**16 - 1], dtype=np.uint16), "uint_contents"),
        "UINT32": (np.array([0, 2**31, 2**32 - 1], dtype=np.uint32), "uint_contents"),
        "INT64": (np.array([-(2**63), -1, 0, 2**63 - 1], dtype=np.int64), "int64_contents"),
        "UINT64": (np.array([0, 2**63, 2**64 - 1], dtype=np.uint64), "uint64_contents"),
    }
    with grpc.insecure_channel(naiad.grpc, options=[("grpc.max_receive_message_length", 1 << 26)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="identity_all")
        for datatype, (values, field) in data.items():
            t = req.inputs.add(name=f"IN_{datatype}", datatype=datatype, shape=[len(values)])
            getattr(t.contents, field).extend(values.tolist())
            req.outputs.add(name=f"OUT_{datatype}")
        resp = stub.ModelInfer(req)
        by_name = {o.name: i for i, o in enumerate(resp.outputs)}
        for datatype, (values, _) in data.items():
            got = np.frombuffer(resp.raw_output_contents[by_name[f"OUT_{datatype}"]], values.dtype)
            np.testing.assert_array_equal(got, values)


@pytest.mark.parametrize(
    "datatype,field,values",
    [
        ("INT8", "int_contents", [1, 300]),
        ("INT8", "int_contents", [-129]),
        ("INT16", "int_contents", [2**15]),
        ("UINT8", "uint_contents", [256]),
        ("UINT16", "uint_contents", [2**16]),
    ],
)
def test_typed_contents_outside_the_datatype_s_range_are_invalid(naiad, datatype, field, values):
    """An INT8/INT16/UINT8/UINT16 input's int_contents/uint_contents value that its type cannot hold is the client's
    error (Triton casts it silently: docs/triton-behaviour.md), as it is in HTTP JSON `data`; the server goes on."""
    with grpc.insecure_channel(naiad.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="identity_all")
        t = req.inputs.add(name=f"IN_{datatype}", datatype=datatype, shape=[len(values)])
        getattr(t.contents, field).extend(values)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            err.value.details() == f"input 'IN_{datatype}': a value of {field} is out of range for {datatype}"
        )
        getattr(t.contents, field)[:] = [1] * len(values)
        assert stub.ModelInfer(req).raw_output_contents[0] == np.ones(len(values), datatype.lower()).tobytes()


def test_infer_onnx_torch_ensemble(grpc_client):
    x = np.random.default_rng(3).random((4, 16), dtype=np.float32)
    inp = grpcclient.InferInput("FEATURES", [4, 16], "FP32")
    inp.set_data_from_numpy(x)
    res = grpc_client.infer("ensemble_mlp", [inp])
    np.testing.assert_allclose(res.as_numpy("DOUBLED"), 2 * res.as_numpy("LOGITS"), rtol=1e-6)
    a = np.ones((1, 5), dtype=np.float32)
    ins = [
        grpcclient.InferInput("INPUT__0", [1, 5], "FP32"),
        grpcclient.InferInput("INPUT__1", [1, 5], "FP32"),
    ]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(3 * a)
    res = grpc_client.infer("add_pt", ins)
    assert res.as_numpy("OUTPUT__0").tolist() == [[4.0] * 5]


@pytest.mark.parametrize(
    "model,inputs,code,message",
    [
        ("nope", [("INPUT0", [1, 1], "FP32")], grpc.StatusCode.NOT_FOUND, "unknown model"),
        ("identity_fp32", [("INPUT0", [1, 1], "INT32")], grpc.StatusCode.INVALID_ARGUMENT, "data-type"),
        ("identity_fp32", [("INPUT0", [9, 1], "FP32")], grpc.StatusCode.INVALID_ARGUMENT, "batch-size"),
        ("add_sub", [("INPUT0", [4], "FP32")], grpc.StatusCode.INVALID_ARGUMENT, "missing required input"),
        (
            "add_sub",
            [("INPUT0", [5], "FP32"), ("INPUT1", [4], "FP32")],
            grpc.StatusCode.INVALID_ARGUMENT,
            "shape",
        ),
    ],
)
def test_errors(grpc_client, model, inputs, code, message):
    ins = []
    for name, shape, dt in inputs:
        i = grpcclient.InferInput(name, shape, dt)
        i.set_data_from_numpy(np.zeros(shape, dtype=np.float32 if dt == "FP32" else np.int32))
        ins.append(i)
    with pytest.raises(InferenceServerException) as info:
        grpc_client.infer(model, ins)
    assert info.value.status() == f"StatusCode.{code.name}"
    assert message in info.value.message()


def test_raw_size_mismatch_is_invalid_argument(naiad):
    with grpc.insecure_channel(naiad.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="identity_fp32")
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
        req.raw_input_contents.append(b"\0" * 12)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_statistics_and_index(grpc_client):
    stats = grpc_client.get_inference_statistics("add_sub")
    assert stats.model_stats[0].name == "add_sub"
    index = grpc_client.get_model_repository_index()
    states = {(m.name, m.state) for m in index.models}
    assert ("add_sub", "READY") in states


def test_stream_infer_non_decoupled(grpc_client):
    results = []
    grpc_client.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        for i in range(5):
            inp = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
            inp.set_data_from_numpy(np.full((1, 2), i, dtype=np.float32))
            grpc_client.async_stream_infer("identity_fp32", [inp], request_id=str(i))
    finally:
        grpc_client.stop_stream()
    assert len(results) == 5 and all(err is None for _, err in results)
    assert sorted(int(r.get_response().id) for r, _ in results) == list(range(5))


async def test_aio_client_concurrent(naiad):
    async with aioclient.InferenceServerClient(naiad.grpc) as client:
        assert await client.is_server_ready()

        async def one(i: int):
            inp = aioclient.InferInput("INPUT0", [2, 3], "FP32")
            inp.set_data_from_numpy(np.full((2, 3), i, dtype=np.float32))
            res = await client.infer("identity_fp32", [inp])
            return res.as_numpy("OUTPUT0")

        outs = await asyncio.gather(*(one(i) for i in range(32)))
        for i, out in enumerate(outs):
            assert out.shape == (2, 3) and (out == i).all()
        md = await client.get_model_metadata("add_sub", as_json=True)
        assert md["name"] == "add_sub"
