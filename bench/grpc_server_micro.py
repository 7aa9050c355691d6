"""In-process CPU cost of Naiad's gRPC server (frontends/grpc/server.py) per unary call (ServerReady): frames
fed to a _Connection over a fake transport.

Run: PYTHONPATH=server python bench/grpc_server_micro.py (compare two checkouts by their server/
directories)."""

import asyncio
import struct
import time

import hpack
from tritonclient.grpc import service_pb2 as pb

from naiad.frontends.grpc import server as grpc_server
from naiad.frontends.grpc.h2 import framing as h2
from naiad.frontends.grpc.messages import Method


class T:
    def __init__(self):
        self.n = 0

    def write(self, d):
        self.n += len(d)

    def writelines(self, chunks):
        self.n += sum(len(x) for x in chunks)

    def get_extra_info(self, *a):
        return None

    def set_write_buffer_limits(self, **kw):
        pass

    def close(self):
        pass

    def is_closing(self):
        return False

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


async def ready(req, ctx):
    return pb.ServerReadyResponse(ready=True)


async def main(n=20000, batch=32):
    srv = grpc_server.H2GrpcServer(
        {b"/inference.GRPCInferenceService/ServerReady": Method(pb.ServerReadyRequest, ready)}
    )
    srv.loop = asyncio.get_running_loop()
    conn = grpc_server._Connection(srv)
    conn.connection_made(T())
    enc = hpack.Encoder()
    hdrs = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/inference.GRPCInferenceService/ServerReady"),
        (":authority", "localhost:8001"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("user-agent", "grpc-python/1.85"),
        ("grpc-accept-encoding", "identity,deflate,gzip"),
    ]
    msg = b"\x00\x00\x00\x00\x00"
    conn.data_received(
        h2.PREFACE
        + h2.frame(h2.SETTINGS, 0, 0, struct.pack(">HI", 4, 2**31 - 1))
        + h2.frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1 - 65535))
    )
    sid = 1

    def req(sid):
        block = enc.encode(hdrs)
        return h2.frame(h2.HEADERS, h2.END_HEADERS, sid, block) + h2.frame(h2.DATA, h2.END_STREAM, sid, msg)

    best = 1e9
    for _rep in range(7):
        chunks = []
        for _i in range(n // batch):
            chunks.append(b"".join(req(sid + 2 * k) for k in range(batch)))
            sid += 2 * batch
        t0 = time.process_time()
        for data in chunks:
            conn.data_received(data)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        dt = time.process_time() - t0
        best = min(best, dt / n * 1e6)
    assert not conn.streams, len(conn.streams)
    print(f"{best:.2f} us/call (best of 7, {n} calls, server side only)")


asyncio.run(main())
