"""Decoupled models: N responses over gRPC ModelStreamInfer and HTTP Server-Sent Events; BLS iterators."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def repeat_inputs(value: int, count: int):
    ins = [grpcclient.InferInput("IN", [1], "INT32"), grpcclient.InferInput("COUNT", [1], "INT32")]
    ins[0].set_data_from_numpy(np.array([value], np.int32))
    ins[1].set_data_from_numpy(np.array([count], np.int32))
    return ins


def stream(naiad, requests_, **kw):
    client = grpcclient.InferenceServerClient(naiad.grpc)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for value, count, rid in requests_:
            client.async_stream_infer("repeat", repeat_inputs(value, count), request_id=rid, **kw)
    finally:
        client.stop_stream()  # waits for the server to close the stream
    out = []
    while not results.empty():
        out.append(results.get())
    return out


def test_grpc_stream_n_responses(naiad):
    got = stream(naiad, [(7, 6, "a"), (9, 3, "b")])
    assert all(err is None for _, err in got)
    by_id: dict = {}
    for result, _ in got:
        resp = result.get_response()
        by_id.setdefault(resp.id, []).append(result)
    assert sorted(int(r.as_numpy("IDX")[0]) for r in by_id["a"]) == list(range(6))
    assert all(int(r.as_numpy("OUT")[0]) == 7 for r in by_id["a"])
    assert len(by_id["b"]) == 3
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in by_id["a"]]
    assert not any(finals)  # the final flag came alone and empty final responses are off


def test_grpc_stream_empty_final_response(naiad):
    got = stream(naiad, [(1, 2, "x")], enable_empty_final_response=True)
    assert len(got) == 3
    last = got[-1][0].get_response()
    assert last.parameters["triton_final_response"].bool_param and len(last.outputs) == 0


def test_grpc_stream_error_response(naiad):
    got = stream(naiad, [(1, -1, "bad"), (1, 1, "good")])
    errors = [err for _, err in got if err is not None]
    assert len(errors) == 1 and "negative COUNT" in str(errors[0])
    assert any(r is not None and r.get_response().id == "good" for r, _ in got)


def test_grpc_stream_large_tensors_byte_for_byte(naiad):
    """4 MiB tensors on one stream: a decoupled model sends one back three times (the final flag with the last),
    a non-decoupled identity once, between small requests; every response byte for byte (Naiad's HTTP/2 server
    receives the large messages into pooled buffers and sends the outputs from their own memory)."""
    rng = np.random.default_rng(3)
    big = [rng.random(1 << 20, dtype=np.float32) for _ in range(2)]
    client = grpcclient.InferenceServerClient(naiad.grpc)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        ins = [grpcclient.InferInput("IN", [1 << 20], "FP32"), grpcclient.InferInput("COUNT", [1], "INT32")]
        ins[0].set_data_from_numpy(big[0])
        ins[1].set_data_from_numpy(np.array([3], np.int32))
        client.async_stream_infer("echo_stream", ins, request_id="decoupled")
        for rid, data in (("small", np.arange(4, dtype=np.float32)[None]), ("identity", big[1][None])):
            inp = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
            inp.set_data_from_numpy(data)
            client.async_stream_infer("identity_fp32", [inp], request_id=rid)
    finally:
        client.stop_stream()
    got: dict = {}
    while not results.empty():
        result, error = results.get()
        assert error is None, error
        got.setdefault(result.get_response().id, []).append(result)
    assert len(got["decoupled"]) == 3
    for result in got["decoupled"]:
        np.testing.assert_array_equal(result.as_numpy("OUT"), big[0])
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in got["decoupled"]]
    assert finals == [False, False, True]
    np.testing.assert_array_equal(got["small"][0].as_numpy("OUTPUT0"), np.arange(4, dtype=np.float32)[None])
    np.testing.assert_array_equal(got["identity"][0].as_numpy("OUTPUT0"), big[1][None])


def test_infer_on_decoupled_model_is_refused(naiad, http_client, grpc_client):
    ins = [httpclient.InferInput("IN", [1], "INT32"), httpclient.InferInput("COUNT", [1], "INT32")]
    for i in ins:
        i.set_data_from_numpy(np.array([1], np.int32))
    with pytest.raises(InferenceServerException, match="decoupled"):
        http_client.infer("repeat", ins)
    with pytest.raises(InferenceServerException, match="decoupled"):
        grpc_client.infer("repeat", repeat_inputs(1, 1))


def test_http_generate_stream_sse(naiad):
    r = requests.post(
        f"{naiad.url}/v2/models/repeat/generate_stream", json={"IN": 5, "COUNT": 4}, stream=True
    )
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[len(b"data: ") :]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert [e["IDX"] for e in events] == [0, 1, 2, 3]
    assert all(e["OUT"] == 5 and e["model_name"] == "repeat" for e in events)


def test_http_generate_stream_error_event(naiad):
    # an error as the first response sets the status (Triton: the first response decides it), still as an event
    r = requests.post(f"{naiad.url}/v2/models/repeat/generate_stream", json={"IN": 5, "COUNT": -1})
    assert r.status_code == 500 and r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert r.text == 'data: {"error":"negative COUNT"}\n\n'


def test_http_generate_single_response(naiad):
    r = requests.post(
        f"{naiad.url}/v2/models/add_sub/generate", json={"INPUT0": [1, 2, 3, 4], "INPUT1": [1, 1, 1, 1]}
    )
    assert r.status_code == 200, r.text
    assert r.json()["OUTPUT0"] == [2, 3, 4, 5] and r.json()["OUTPUT1"] == [0, 1, 2, 3]
    r = requests.post(f"{naiad.url}/v2/models/repeat/generate", json={"IN": 1, "COUNT": 3})
    assert r.status_code == 400 and "exactly 1 response" in r.json()["error"]
    # a key that names no input is a request parameter (Triton's mapping): here the inputs are then missing
    r = requests.post(f"{naiad.url}/v2/models/add_sub/generate", json={"NOPE": 1})
    assert r.status_code == 400 and "expected 2 inputs but got 0" in r.json()["error"]


def test_bls_iterates_decoupled_responses(http_client):
    inp = httpclient.InferInput("COUNT", [1], "INT32")
    inp.set_data_from_numpy(np.array([5], np.int32))
    assert http_client.infer("bls_decoupled", [inp]).as_numpy("SUM").tolist() == [0 + 1 + 2 + 3 + 4]


def test_decoupled_response_statistics(http_client):
    stats = http_client.get_inference_statistics("repeat")["model_stats"][0]
    assert stats["response_stats"]  # per-response-index counters for decoupled models
    assert stats["response_stats"]["0"]["success"]["count"] >= 1
