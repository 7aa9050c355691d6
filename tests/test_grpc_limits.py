"""gRPC keepalive (Triton's --grpc-keepalive-* / --grpc-http2-* flags), ping strikes, grpc-timeout deadlines
and SETTINGS_MAX_CONCURRENT_STREAMS, on both gRPC implementations, with tritonclient and a raw HTTP/2 client."""

from __future__ import annotations

import shutil
import struct
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from h2frames import DATA, END_STREAM, HEADERS, PING, RST_STREAM, SETTINGS, RawH2, frame, goaway, grpc_message
from helpers import ROOT, NaiadProcess
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(scope="module", params=["naiad", "grpcio"])
def server(request, tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for name in ("slow", "identity_fp32"):
        shutil.copytree(ROOT / "tests" / "models" / name, repo / name)
    args = [
        "--grpc-implementation",
        request.param,
        "--grpc-keepalive-time",
        "500",
        "--grpc-keepalive-timeout",
        "500",
        "--grpc-keepalive-permit-without-calls",
        "true",
    ]
    with NaiadProcess(repo, *args) as proc:
        proc.implementation = request.param
        yield proc


def _slow_request(seconds: float) -> bytes:
    req = pb.ModelInferRequest(model_name="slow")
    t = req.inputs.add(name="SECONDS", datatype="FP32")
    t.shape.append(1)
    req.raw_input_contents.append(np.array([seconds], dtype=np.float32).tobytes())
    return grpc_message(req.SerializeToString())


def _identity_works(server) -> None:
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        data = np.arange(4, dtype=np.float32).reshape(1, 4)
        inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(data)
        np.testing.assert_array_equal(client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), data)
    finally:
        client.close()


def test_aggressive_keepalive_client_is_refused(server):
    """A client asking for a keepalive PING every 100 ms (grpc core sends one a second at most), during a long
    call: more than http2_max_ping_strikes pings inside http2_min_recv_ping_interval_without_data (5 minutes)
    get GOAWAY ENHANCE_YOUR_CALM "too_many_pings", which fails the call as UNAVAILABLE "Too many pings"."""
    ka = grpcclient.KeepAliveOptions(
        keepalive_time_ms=100,
        keepalive_timeout_ms=5000,
        keepalive_permit_without_calls=True,
        http2_max_pings_without_data=0,
    )
    client = grpcclient.InferenceServerClient(server.grpc, keepalive_options=ka)
    try:
        inp = grpcclient.InferInput("SECONDS", [1], "FP32")
        inp.set_data_from_numpy(np.array([8.0], dtype=np.float32))
        start = time.monotonic()
        with pytest.raises(InferenceServerException) as err:
            client.infer("slow", [inp])
        assert err.value.status() == "StatusCode.UNAVAILABLE", err.value
        assert "too_many_pings" in str(err.value) or "Too many pings" in str(err.value), err.value
        assert time.monotonic() - start < 6.5
    finally:
        client.close()
    _identity_works(server)


def test_client_that_stops_answering_pings_is_dropped(server):
    with RawH2(server.grpc) as dead:
        start = time.monotonic()
        dead.send(frame(SETTINGS, 1, 0))  # it acknowledges the server's SETTINGS, but never a PING
        frames = dead.frames(timeout=10)
        assert dead.closed, "the connection was not closed"
        elapsed = time.monotonic() - start
        assert any(f[0] == PING and not f[1] & 1 for f in frames), frames
        assert elapsed < 4.0, elapsed
    # a client that answers its PINGs stays
    with RawH2(server.grpc) as alive:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for ftype, flags, _, payload in alive.frames(timeout=0.2):
                if ftype == PING and not flags & 1:
                    alive.send(frame(PING, 1, 0, payload))
                if ftype == SETTINGS and not flags & 1:
                    alive.send(frame(SETTINGS, 1, 0))
        assert not alive.closed
    _identity_works(server)


def _status(conn: RawH2, sid: int, timeout: float) -> str | None:
    """grpc-status of stream `sid`'s trailers (or RST_STREAM as 'RST <code>')."""
    for ftype, flags, fsid, payload in conn.frames(
        timeout=timeout,
        until=lambda f: f[2] == sid and (f[0] == RST_STREAM or (f[0] == HEADERS and f[1] & 1)),
    ):
        if fsid != sid:
            continue
        if ftype == RST_STREAM:
            return f"RST {struct.unpack('>I', payload)[0]}"
        if ftype == HEADERS and flags & END_STREAM:
            return conn.decode(payload).get("grpc-status")
    return None


def _inference_count(server) -> int:
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        stats = client.get_inference_statistics("slow", as_json=True)["model_stats"][0]
        return int(stats.get("inference_stats", {}).get("success", {}).get("count", 0))
    finally:
        client.close()


def test_grpc_timeout_ends_the_call_and_drops_its_queued_work(server):
    """The server enforces grpc-timeout itself (the raw client never resets its streams): DEADLINE_EXCEEDED
    at the deadline; of 8 one-second calls on the 4 instances of `slow`, the 4 still queued never run."""
    before = _inference_count(server)
    with RawH2(server.grpc) as conn:
        start = time.monotonic()
        sids = list(range(1, 17, 2))
        for sid in sids:
            conn.send(
                conn.request_headers(INFER, ("grpc-timeout", "300m"), sid=sid)
                + frame(DATA, END_STREAM, sid, _slow_request(1.0))
            )
        statuses = {}
        while len(statuses) < len(sids) and time.monotonic() - start < 5:
            for ftype, flags, sid, payload in conn.frames(timeout=0.5):
                if ftype == HEADERS and flags & END_STREAM:
                    statuses[sid] = conn.decode(payload).get("grpc-status")
        elapsed = time.monotonic() - start
    assert statuses == dict.fromkeys(sids, "4"), statuses  # DEADLINE_EXCEEDED
    assert elapsed < 1.5, elapsed
    time.sleep(2.5)  # the 4 that started finish; the queued 4 must not run
    assert _inference_count(server) - before <= 4
    _identity_works(server)


def test_max_concurrent_streams(server):
    with RawH2(server.grpc) as conn:
        settings = [f for f in conn.frames(timeout=2, until=lambda f: f[0] == SETTINGS) if f[0] == SETTINGS]
        assert settings
        values = dict(
            struct.unpack(">HI", settings[0][3][i : i + 6]) for i in range(0, len(settings[0][3]), 6)
        )
        assert values.get(3) == 100  # SETTINGS_MAX_CONCURRENT_STREAMS
        if server.implementation != "naiad":
            return
        conn.send(frame(SETTINGS, 1, 0))
        # 101 calls that wait for their request body: the 101st is refused
        conn.send(b"".join(conn.request_headers(INFER, sid=2 * i + 1) for i in range(101)))
        assert _status(conn, 201, timeout=3) == "RST 7"  # REFUSED_STREAM
        assert goaway(conn.frames(timeout=0.2)) is None
    _identity_works(server)
