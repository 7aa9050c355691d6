"""Bad input never crashes or hangs the server: every malformed request gets a 4xx and the server keeps serving."""

from __future__ import annotations

import json
import random
import socket

import grpc
import requests
from tritonclient.grpc import service_pb2, service_pb2_grpc

BASE = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def mutations(rng: random.Random):
    text = json.dumps(BASE)
    for _ in range(60):
        kind = rng.randrange(6)
        if kind == 0:  # truncated JSON
            yield text[: rng.randrange(len(text))].encode(), {}
        elif kind == 1:  # random bytes
            yield bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), {}
        elif kind == 2:  # hostile shapes
            shape = rng.choice(
                [[-1, 4], [2**62, 2**62], [0], [], [1, 4, 1, 1, 1, 1, 1], ["a"], [1.5], [True]]
            )
            yield json.dumps({"inputs": [{**BASE["inputs"][0], "shape": shape}]}).encode(), {}
        elif kind == 3:  # lying binary sizes
            n = rng.choice([-5, 0, 3, 17, 2**40])
            body = json.dumps(
                {
                    "inputs": [
                        {
                            "name": "INPUT0",
                            "shape": [1, 4],
                            "datatype": "FP32",
                            "parameters": {"binary_data_size": n},
                        }
                    ]
                }
            ).encode()
            yield body + b"\0" * 16, {"Inference-Header-Content-Length": str(len(body))}
        elif kind == 4:  # wrong JSON types everywhere
            field = rng.choice(["inputs", "outputs", "parameters", "id"])
            yield json.dumps({**BASE, field: rng.choice([None, 7, "x", [1], {"a": 1}])}).encode(), {}
        else:  # deep nesting and odd data
            data = rng.choice([[[[[1]]]], [None] * 4, ["1", "2", "3", "4"], [1e400] * 4, {"x": 1}])
            yield (
                json.dumps({"inputs": [{**BASE["inputs"][0], "data": data}]})
                .replace("Infinity", "1e999")
                .encode(),
                {},
            )


def test_malformed_http_requests(naiad):
    rng = random.Random(1234)
    for body, headers in mutations(rng):
        r = requests.post(
            f"{naiad.url}/v2/models/identity_fp32/infer", data=body, headers=headers, timeout=10
        )
        if r.status_code != 200:
            assert 400 <= r.status_code < 500, (body[:200], r.status_code, r.text)
            assert "error" in r.json()
    assert (
        requests.post(f"{naiad.url}/v2/models/identity_fp32/infer", json=BASE, timeout=10).status_code == 200
    )


def test_garbage_on_the_wire(naiad):
    host, port = naiad.http.split(":")
    for payload in (
        b"\x16\x03\x01\x02\x00" + b"\0" * 64,
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nContent-Length: 100000\r\n\r\n{",
    ):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            try:
                s.recv(1024)
            except OSError:
                pass
    assert requests.get(f"{naiad.url}/v2/health/live", timeout=5).status_code == 200


def test_malformed_grpc_requests(naiad):
    rng = random.Random(99)
    with grpc.insecure_channel(naiad.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(40):
            req = service_pb2.ModelInferRequest(
                model_name=rng.choice(["identity_fp32", "add_sub", "", "x" * 300])
            )
            for _i in range(rng.randrange(3)):
                t = req.inputs.add(
                    name=rng.choice(["INPUT0", "INPUT1", ""]),
                    datatype=rng.choice(["FP32", "BYTES", "INT8", "??"]),
                    shape=[rng.choice([-3, 0, 1, 4, 2**40]) for _ in range(rng.randrange(3))],
                )
                if rng.random() < 0.5:
                    req.raw_input_contents.append(bytes(rng.randrange(256) for _ in range(rng.randrange(40))))
                else:
                    t.contents.fp32_contents.extend([1.0] * rng.randrange(5))
            try:
                stub.ModelInfer(req, timeout=10)
            except grpc.RpcError as err:
                assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), err
        assert stub.ServerLive(service_pb2.ServerLiveRequest()).live
