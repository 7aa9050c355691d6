"""Naiad's own HTTP/2 gRPC server (naiad/frontends/grpc/server.py) against real gRPC clients and raw frames:
flow control with large messages, compression, cancellation, many concurrent streams, unknown methods,
health Watch, protocol errors; and the grpc.aio implementation still selectable."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import grpc
import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from helpers import NaiadProcess
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException


def _identity(client, data: np.ndarray, **kw) -> np.ndarray:
    inp = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    return client.infer("identity_fp32", [inp], **kw).as_numpy("OUTPUT0")


def test_large_messages_cross_flow_control_windows(grpc_client):
    """16 MiB each way: more than our per-stream receive window and the client's initial send window."""
    data = np.random.default_rng(0).random((1, 4 * 1024 * 1024), dtype=np.float32)
    np.testing.assert_array_equal(_identity(grpc_client, data), data)
    small = np.arange(16, dtype=np.float32).reshape(1, 16)
    np.testing.assert_array_equal(_identity(grpc_client, small), small)  # the connection is still fine


def test_large_reply_of_a_call_answered_in_its_frame_handler_waits_for_window(grpc_client):
    """Once the model executes inline (after a few dozen fast calls) a unary call completes in the frame
    handler that received its request (transport/eager.py); a 16 MiB reply must still go out as the client's
    window opens."""
    small = np.arange(16, dtype=np.float32).reshape(1, 16)
    for _ in range(64):  # InlinePolicy.QUALIFY executions under its limit
        _identity(grpc_client, small)
    data = np.random.default_rng(1).random((1, 4 * 1024 * 1024), dtype=np.float32)
    np.testing.assert_array_equal(_identity(grpc_client, data), data)
    np.testing.assert_array_equal(_identity(grpc_client, small), small)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(grpc_client, algorithm):
    data = np.linspace(0, 1, 4096, dtype=np.float32).reshape(1, -1)
    np.testing.assert_array_equal(_identity(grpc_client, data, compression_algorithm=algorithm), data)


def test_many_concurrent_calls_on_one_channel(naiad):
    async def main():
        client = grpcaio.InferenceServerClient(naiad.grpc)
        try:

            async def one(i):
                data = np.full((1, 8), i, dtype=np.float32)
                inp = grpcaio.InferInput("INPUT0", [1, 8], "FP32")
                inp.set_data_from_numpy(data)
                res = await client.infer("identity_fp32", [inp], request_id=str(i))
                assert res.get_response().id == str(i)
                np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), data)

            await asyncio.gather(*(one(i) for i in range(300)))
        finally:
            await client.close()

    asyncio.run(main())


def test_client_deadline_cancels_and_the_server_goes_on(naiad, grpc_client):
    inp = grpcclient.InferInput("SECONDS", [1], "FP32")
    inp.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    with pytest.raises(InferenceServerException, match="Deadline"):
        grpc_client.infer("slow", [inp], client_timeout=0.2)
    small = np.ones((1, 4), dtype=np.float32)
    np.testing.assert_array_equal(_identity(grpc_client, small), small)


def test_unknown_method_is_unimplemented(naiad):
    with grpc.insecure_channel(naiad.grpc) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/NoSuchMethod",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.ServerLiveResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            call(pb.ServerLiveRequest())
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # a message that is not a ModelInferRequest: INTERNAL, and the channel keeps working
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff")
        assert err.value.code() == grpc.StatusCode.INTERNAL
        live = channel.unary_unary(
            "/inference.GRPCInferenceService/ServerLive",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.ServerLiveResponse.FromString,
        )
        assert live(pb.ServerLiveRequest()).live


def test_health_check_and_watch(naiad):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(naiad.grpc) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert (
            stub.Check(health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService")).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="nope"))
        assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()


def test_decoupled_stream_many_responses(grpc_client):
    got = []
    grpc_client.start_stream(callback=lambda result, error: got.append((result, error)))
    try:
        a = grpcclient.InferInput("IN", [1], "INT32")
        a.set_data_from_numpy(np.array([7], dtype=np.int32))
        b = grpcclient.InferInput("COUNT", [1], "INT32")
        b.set_data_from_numpy(np.array([200], dtype=np.int32))
        grpc_client.async_stream_infer("repeat", [a, b], request_id="r")
        deadline = time.time() + 20
        while len(got) < 200 and time.time() < deadline:
            time.sleep(0.02)
    finally:
        grpc_client.stop_stream()
    assert [e for _, e in got if e is not None] == []
    assert sorted(int(r.as_numpy("IDX")[0]) for r, _ in got) == list(range(200))


# ---- raw HTTP/2 ----


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", len(payload) << 8 | ftype, flags, sid) + payload


def _read_frames(sock, until_type: int, timeout: float = 5.0):
    sock.settimeout(timeout)
    buf = b""
    frames = []
    while True:
        while len(buf) >= 9:
            lt, flags, sid = struct.unpack(">IBI", buf[:9])
            n = lt >> 8
            if len(buf) < 9 + n:
                break
            frames.append((lt & 0xFF, flags, sid, buf[9 : 9 + n]))
            buf = buf[9 + n :]
            if frames[-1][0] == until_type:
                return frames
        chunk = sock.recv(65536)
        if not chunk:
            return frames
        buf += chunk


def _connect(naiad):
    host, port = naiad.grpc.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0))
    return sock


def test_raw_ping_and_trailers_only_error(naiad):
    enc = hpack.Encoder()
    with _connect(naiad) as sock:
        sock.sendall(_frame(6, 0, 0, b"12345678"))
        frames = _read_frames(sock, 6)
        assert (6, 1, 0, b"12345678") in frames  # PING ACK with our payload
        headers = enc.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/inference.Nope/X"),
                (":authority", "x"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
        )
        sock.sendall(_frame(1, 0x4 | 0x1, 1, headers))
        frames = _read_frames(sock, 1)
        block = dict(hpack.Decoder().decode(frames[-1][3]))
        assert frames[-1][1] & 0x1 and block[":status"] == "200" and block["grpc-status"] == "12"
        # a plain HTTP request on a gRPC path: 415 (content type), then 405 (method)
        sock.sendall(
            _frame(
                1,
                0x5,
                3,
                enc.encode(
                    [
                        (":method", "POST"),
                        (":scheme", "http"),
                        (":path", "/a"),
                        (":authority", "x"),
                        ("content-type", "text/plain"),
                    ]
                ),
            )
        )
        assert dict(hpack.Decoder().decode(_read_frames(sock, 1)[-1][3]))[":status"] == "415"


def test_a_client_goaway_is_answered_like_any_frame_until_the_client_closes(naiad):
    with _connect(naiad) as sock:
        # GOAWAY with an error code the RFC does not define, and a PING right behind it in the same segment
        sock.sendall(_frame(7, 0, 0, struct.pack(">II", 0, 0xFF)) + _frame(6, 0, 0, b"stillok?"))
        assert (6, 1, 0, b"stillok?") in _read_frames(sock, 6)  # an answer, not a closed or reset connection


def test_raw_protocol_errors_close_only_that_connection(naiad, grpc_client):
    with _connect(naiad) as sock:
        sock.sendall(_frame(0, 0, 99, b"data on a stream that was never opened"))
        frames = _read_frames(sock, 7)
        assert frames and frames[-1][0] == 7 and struct.unpack(">II", frames[-1][3][:8])[1] == 1  # GOAWAY
    host, port = naiad.grpc.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        data = sock.recv(4096)
        while True:  # GOAWAY, then the server closes
            more = sock.recv(4096)
            if not more:
                break
            data += more
        assert b"preface" in data
    assert grpc_client.is_server_live()


def test_grpcio_implementation_still_serves(model_repo):
    with NaiadProcess(
        model_repo,
        "--grpc-implementation",
        "grpcio",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "identity_fp32",
        "--load-model",
        "repeat",
    ) as proc:
        client = grpcclient.InferenceServerClient(proc.grpc)
        try:
            data = np.arange(6, dtype=np.float32).reshape(1, 6)
            np.testing.assert_array_equal(_identity(client, data), data)
            assert test_decoupled_stream_many_responses(client) is None
        finally:
            client.close()
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(proc.grpc) as channel:
            assert (
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
                == health_pb2.HealthCheckResponse.SERVING
            )


def test_pings_while_a_reply_waits_for_window_are_not_strikes(naiad):
    """grpcio's clients send BDP pings while a large reply arrives. Each DATA frame the server writes starts its
    ping policy over (as grpcio's server does), also the frames of a reply that waited for window: a reply that
    crosses many windows is not cut off with GOAWAY too_many_pings (seen under load with 256 MiB replies)."""
    from h2frames import DATA, END_STREAM, GOAWAY, PING, WINDOW_UPDATE, RawH2, frame, grpc_message

    n = 128 << 10  # 512 KiB of FP32 each way: eight of the client's 64 KiB stream windows
    req = pb.ModelInferRequest(model_name="identity_fp32")
    tensor = req.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.extend([1, n])
    req.raw_input_contents.append(bytes(4 * n))
    body = grpc_message(req.SerializeToString())
    with RawH2(naiad.grpc) as conn:
        conn.send(conn.request_headers("/inference.GRPCInferenceService/ModelInfer"))
        for pos in range(0, len(body), 16384):
            last = END_STREAM if pos + 16384 >= len(body) else 0
            conn.send(frame(DATA, last, 1, body[pos : pos + 16384]))
        received, ended, rounds = 0, False, 0
        while not ended and rounds < 40:
            frames = conn.frames(timeout=0.5)
            assert not [f for f in frames if f[0] == GOAWAY], frames[-1]
            assert not conn.closed, "the server closed the connection"
            received += sum(len(f[3]) for f in frames if f[0] == DATA and f[2] == 1)
            ended = any(f[2] == 1 and f[1] & END_STREAM for f in frames)
            # as a grpcio client does: a (BDP) ping, then the window for the next part of the reply
            conn.send(frame(PING, 0, 0, struct.pack(">Q", rounds)))
            conn.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 65535)))
            conn.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 65535)))
            rounds += 1
        assert ended and received >= 4 * n, (received, rounds)
        assert rounds >= 6


def test_a_large_reply_goes_out_in_full_frames_of_the_size_the_client_allows(naiad):
    """A client that keeps the default 16 KiB SETTINGS_MAX_FRAME_SIZE (h2load, grpc-go, grpc-java) and opens
    wide windows: a 4 MiB reply goes out in full 16 KiB DATA frames (the tensor's share one header), the last
    one short, and the message read back from them is the tensor byte for byte."""
    from h2frames import DATA, END_STREAM, HEADERS, SETTINGS, WINDOW_UPDATE, RawH2, frame, grpc_message

    n = 1 << 20  # 4 MiB of FP32
    data = np.random.default_rng(7).random(n, dtype=np.float32)
    req = pb.ModelInferRequest(model_name="identity_fp32")
    tensor = req.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.extend([1, n])
    req.raw_input_contents.append(data.tobytes())
    body = grpc_message(req.SerializeToString())
    # SETTINGS_INITIAL_WINDOW_SIZE: every stream's window at its largest
    window = struct.pack(">HI", 4, (1 << 31) - 1)
    with RawH2(naiad.grpc, settings=window) as conn:
        conn.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", (1 << 31) - 1 - 65535)))
        conn.send(conn.request_headers("/inference.GRPCInferenceService/ModelInfer"))
        for pos in range(0, len(body), 16384):
            last = END_STREAM if pos + 16384 >= len(body) else 0
            conn.send(frame(DATA, last, 1, body[pos : pos + 16384]))
        frames = conn.frames(timeout=30, until=lambda f: f[0] == HEADERS and f[1] & END_STREAM)
    assert not conn.closed
    sizes = [len(f[3]) for f in frames if f[0] == DATA and f[2] == 1]
    assert max(sizes) == 16384 and all(s == 16384 for s in sizes[:-1]), sizes[:8]
    assert [f for f in frames if f[0] == SETTINGS or f[2] == 1][-1][0] == HEADERS  # the trailers come last
    message = b"".join(f[3] for f in frames if f[0] == DATA and f[2] == 1)
    assert int.from_bytes(message[1:5], "big") == len(message) - 5
    reply = pb.ModelInferResponse.FromString(message[5:])
    assert reply.outputs[0].name == "OUTPUT0" and list(reply.outputs[0].shape) == [1, n]
    assert reply.raw_output_contents[0] == data.tobytes()
