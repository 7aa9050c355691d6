"""Large tensors read into pooled receive buffers (transport/receive_buffers.py): 16 MiB and odd-sized tensors
of several datatypes come back byte for byte over HTTP binary, HTTP JSON and gRPC, one at a time and
concurrently with different payloads (a buffer a request still uses is never handed to another), and bodies
that arrive in pieces or with a pipelined request behind them."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import NaiadProcess

from naiad.frontends.transport.receive_buffers import ReceivePool, size_class

MODELS = Path(__file__).parent / "models"
MODEL = "identity_all"  # echoes each IN_<type> as OUT_<type>
MIB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("large") / "models"
    shutil.copytree(MODELS / MODEL, repo / MODEL)
    proc = NaiadProcess(repo)
    proc.start()
    yield proc
    proc.stop()


def tensors_for(seed: int, odd: bool) -> dict[str, np.ndarray]:
    """16 MiB of FP32 and, with `odd`, 16 MiB + 3 bytes of UINT8 plus INT64 and FP16 tensors."""
    rng = np.random.default_rng(seed)
    out = {"FP32": rng.random(4 * MIB, dtype=np.float32)}
    if odd:
        out["UINT8"] = rng.integers(0, 256, 16 * MIB + 3, dtype=np.uint8)
        out["INT64"] = rng.integers(-(2**62), 2**62, 65537, dtype=np.int64)
        out["FP16"] = rng.random(100003).astype(np.float16)
    return out


def http_infer(
    proc: NaiadProcess, arrays: dict[str, np.ndarray], binary: bool = True
) -> dict[str, np.ndarray]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(proc.http, connection_timeout=120, network_timeout=120)
    try:
        inputs, outputs = [], []
        for dtype, arr in arrays.items():
            i = httpclient.InferInput(f"IN_{dtype}", list(arr.shape), dtype)
            i.set_data_from_numpy(arr, binary_data=binary)
            inputs.append(i)
            outputs.append(httpclient.InferRequestedOutput(f"OUT_{dtype}", binary_data=binary))
        result = client.infer(MODEL, inputs, outputs=outputs)
        return {dtype: result.as_numpy(f"OUT_{dtype}") for dtype in arrays}
    finally:
        client.close()


def grpc_infer(proc: NaiadProcess, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(proc.grpc)
    try:
        inputs = []
        for dtype, arr in arrays.items():
            i = grpcclient.InferInput(f"IN_{dtype}", list(arr.shape), dtype)
            i.set_data_from_numpy(arr)
            inputs.append(i)
        outputs = [grpcclient.InferRequestedOutput(f"OUT_{dtype}") for dtype in arrays]
        result = client.infer(MODEL, inputs, outputs=outputs, client_timeout=120)
        return {dtype: result.as_numpy(f"OUT_{dtype}") for dtype in arrays}
    finally:
        client.close()


def same_bytes(got: dict[str, np.ndarray], sent: dict[str, np.ndarray]) -> None:
    assert set(got) == set(sent)
    for dtype, arr in sent.items():
        assert got[dtype].dtype == arr.dtype, dtype
        assert got[dtype].shape == arr.shape, dtype
        assert got[dtype].tobytes() == arr.tobytes(), f"{dtype}: bytes differ"


@pytest.mark.parametrize("infer", [http_infer, grpc_infer], ids=["http_binary", "grpc"])
def test_large_tensors_byte_for_byte(server, infer):
    for seed in (1, 2):  # the second request reuses the first one's buffer
        sent = tensors_for(seed, odd=True)
        same_bytes(infer(server, sent), sent)


@pytest.mark.parametrize("infer", [http_infer, grpc_infer], ids=["http_binary", "grpc"])
def test_concurrent_different_payloads(server, infer):
    """Six clients at once, each sending its own payloads several times: every answer is its own."""
    errors: list[str] = []

    def client(k: int) -> None:
        try:
            for i in range(3):
                sent = tensors_for(100 * k + i, odd=(i == 1))
                same_bytes(infer(server, sent), sent)
        except Exception as exc:  # reported below, with the client it came from
            errors.append(f"client {k}: {exc!r}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_http_json_large_body(server):
    rng = np.random.default_rng(7)
    sent = {"INT32": rng.integers(-(2**31), 2**31 - 1, 200_003, dtype=np.int32)}  # ~2.2 MB of JSON
    same_bytes(http_infer(server, sent, binary=False), sent)


def binary_request(arr: np.ndarray, dtype: str, keep_alive: bool = True) -> bytes:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": f"IN_{dtype}",
                    "shape": list(arr.shape),
                    "datatype": dtype,
                    "parameters": {"binary_data_size": arr.nbytes},
                }
            ],
            "outputs": [{"name": f"OUT_{dtype}", "parameters": {"binary_data": True}}],
        }
    ).encode()
    body = header + arr.tobytes()
    head = (
        f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\n"
        + ("" if keep_alive else "Connection: close\r\n")
        + "\r\n"
    ).encode()
    return head + body


def read_response(sock: socket.socket, buf: bytearray) -> tuple[dict, bytes]:
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(1 << 20)
        assert chunk, "connection closed before a response"
        buf += chunk
    end = buf.index(b"\r\n\r\n")
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 200"), lines[0]
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    n = int(headers["content-length"])
    del buf[: end + 4]
    while len(buf) < n:
        chunk = sock.recv(1 << 20)
        assert chunk, "connection closed mid-body"
        buf += chunk
    body = bytes(buf[:n])
    del buf[:n]
    return headers, body


def test_http_body_in_pieces_then_pipelined(server):
    """A large body sent in uneven pieces with pauses, a small request pipelined right behind it in the
    same write as the body's end, then another large one: three answers, in order, byte for byte."""
    rng = np.random.default_rng(11)
    big = rng.integers(0, 256, 3 * MIB + 5, dtype=np.uint8)
    small = np.arange(7, dtype=np.int32)
    big2 = rng.random(MIB + 1, dtype=np.float32)
    first = binary_request(big, "UINT8")
    stream = first + binary_request(small, "INT32") + binary_request(big2, "FP32")
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=60) as sock:
        cut = [100, 70_000, len(first) // 2, len(first) - 10, len(first) + 50, len(stream)]
        pos = 0
        for c in cut:
            sock.sendall(stream[pos:c])
            pos = c
            time.sleep(0.05)
        buf = bytearray()
        for arr in (big, small, big2):
            headers, body = read_response(sock, buf)
            head_len = int(headers["inference-header-content-length"])
            assert body[head_len:] == arr.tobytes()


def test_receive_pool_reuses_only_free_buffers():
    pool = ReceivePool(limit=64 * MIB)
    a = pool.take(10 * MIB)
    assert len(a) == size_class(10 * MIB) >= 10 * MIB
    view = np.frombuffer(memoryview(a).toreadonly(), dtype=np.uint8)
    a_id = id(a)
    del a
    b = pool.take(10 * MIB)  # the first is still referenced (through `view`): a new buffer
    assert id(b) != a_id
    b[:4] = b"abcd"
    del view
    c = pool.take(10 * MIB)  # now the first is free again
    assert id(c) == a_id
    del b, c
    assert pool.idle_bytes() == pool.bytes == 2 * size_class(10 * MIB)
    big = pool.take(50 * MIB)  # over the limit: idle buffers are dropped to make room
    assert pool.bytes <= 64 * MIB
    assert len(big) >= 50 * MIB


def test_large_tensors_over_tls(tmp_path_factory):
    """The same buffers behind TLS (uvloop's SSL transport hands a BufferedProtocol the decrypted bytes)."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from pki import Pki

    repo = tmp_path_factory.mktemp("large-tls") / "models"
    shutil.copytree(MODELS / MODEL, repo / MODEL)
    pki = Pki(tmp_path_factory.mktemp("pki"), "naiad-test-ca")
    cert, key = pki.issue("server")
    args = []
    for endpoint in ("grpc", "http"):
        args += [
            f"--{endpoint}-server-cert",
            cert,
            f"--{endpoint}-server-key",
            key,
            f"--{endpoint}-use-ssl=true",
        ]
    sent = tensors_for(5, odd=True)
    with NaiadProcess(repo, *args) as proc:
        for _ in range(2):
            h = httpclient.InferenceServerClient(
                f"localhost:{proc.http_port}", ssl=True, ssl_options={"ca_certs": pki.ca}, network_timeout=120
            )
            g = grpcclient.InferenceServerClient(
                f"localhost:{proc.grpc_port}", ssl=True, root_certificates=pki.ca
            )
            try:
                for module, client in ((httpclient, h), (grpcclient, g)):
                    inputs = []
                    for dtype, arr in sent.items():
                        i = module.InferInput(f"IN_{dtype}", list(arr.shape), dtype)
                        i.set_data_from_numpy(arr)
                        inputs.append(i)
                    result = client.infer(MODEL, inputs)
                    same_bytes({dtype: result.as_numpy(f"OUT_{dtype}") for dtype in sent}, sent)
            finally:
                h.close()
                g.close()


def raw_grpc_call(server, message: bytes, cuts: list[int], claimed: int | None = None) -> tuple[dict, bytes]:
    """One ModelInfer over a raw HTTP/2 connection: the gRPC message (its length prefix saying `claimed`
    bytes, if given) as DATA frames ending at each offset in `cuts`, each frame written in two pieces with a
    pause between them; (trailers, response message)."""
    from h2frames import DATA, END_STREAM, HEADERS, WINDOW_UPDATE, RawH2, frame

    body = struct.pack(">BI", 0, len(message) if claimed is None else claimed) + message
    with RawH2(server.grpc, settings=struct.pack(">HI", 4, 1 << 30)) as conn:  # (the response needs window)
        conn.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 30)))
        conn.send(conn.request_headers("/inference.GRPCInferenceService/ModelInfer"))
        start = 0
        for i, end in enumerate(cuts):
            data = frame(DATA, END_STREAM if i == len(cuts) - 1 else 0, 1, body[start:end])
            half = len(data) // 3
            conn.send(data[:half])
            time.sleep(0.05)
            conn.send(data[half:])
            start = end
        frames = conn.frames(timeout=30, until=lambda f: f[0] == HEADERS and f[1] & END_STREAM)
        trailers, payload = {}, b""
        for ftype, _, _, data in frames:
            if ftype == HEADERS:
                trailers.update(conn.decode(data))
            elif ftype == DATA:
                payload += data
        return trailers, payload[5:]


def test_grpc_large_frames_read_in_place(server):
    """Large DATA frames that arrive in pieces (read straight into the message buffer), then messages whose
    length prefix says more or less than what comes: a clear INTERNAL error, and the connection still works."""
    from tritonclient.grpc import service_pb2 as pb

    arr = np.random.default_rng(3).integers(0, 256, 700_001, dtype=np.uint8)
    req = pb.ModelInferRequest(model_name=MODEL)
    t = req.inputs.add(name="IN_UINT8", datatype="UINT8")
    t.shape.append(arr.size)
    req.raw_input_contents.append(arr.tobytes())
    msg = req.SerializeToString()
    n = len(msg) + 5
    for cuts in ([n], [300_000, n], [1000, 600_000, n]):
        trailers, payload = raw_grpc_call(server, msg, cuts)
        assert trailers.get("grpc-status") == "0", trailers
        resp = pb.ModelInferResponse.FromString(payload)
        assert resp.raw_output_contents[0] == arr.tobytes()
    for claimed in (len(msg) - 100_000, len(msg) + 100_000):
        trailers, _ = raw_grpc_call(server, msg, [400_000, n], claimed=claimed)
        assert trailers.get("grpc-status") == "13", trailers
        assert "expected one request message of" in trailers.get("grpc-message", ""), trailers
    same_bytes(grpc_infer(server, {"UINT8": arr}), {"UINT8": arr})
