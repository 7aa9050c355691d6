"""`--frontend-accept balanced` with `--frontend-workers 2`: the engine's acceptor hands each connection to the
least-loaded worker (long-lived gRPC channels and HTTP keep-alive connections split 2+2), TLS through it, and a
killed worker's replacement taking the next connections."""

from __future__ import annotations

import gc
import http.client
import shutil
import signal
import ssl
import time

import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
from helpers import ROOT, NaiadProcess
from pki import Pki
from test_frontend_workers import wait_for, worker_pids

from naiad.engine.acceptor import GRPC, HTTP, Acceptor, WorkerSlot

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # a channel of its own, not a shared subchannel


def held(pid: int, port: int) -> int:
    """Established connections to `port` that worker `pid` holds."""
    try:
        conns = psutil.Process(pid).net_connections("tcp")
    except psutil.NoSuchProcess:
        return 0
    return sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)


def owner(pids: list[int], conn: http.client.HTTPConnection) -> int | None:
    port = conn.sock.getsockname()[1]
    for pid in pids:
        try:
            if any(c.raddr and c.raddr.port == port for c in psutil.Process(pid).net_connections("tcp")):
                return pid
        except psutil.NoSuchProcess:
            pass
    return None


def settle(server: NaiadProcess, pids: list[int]) -> None:
    """Until the workers hold no connection and have told the acceptor so (a worker reports each close at once)."""
    gc.collect()  # e.g. the readiness probe's connection, held by a reference cycle in requests
    ports = (server.http_port, server.grpc_port)
    wait_for(lambda: not any(held(p, port) for p in pids for port in ports), 10, "no open connections")
    time.sleep(0.3)


def make_repo(path):
    shutil.copytree(ROOT / "tests" / "models" / "identity_fp32", path / "identity_fp32")
    return path


def keep_alive(server: NaiadProcess) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection(*server.http.split(":"), timeout=10)
    conn.request("GET", "/v2/health/ready")
    response = conn.getresponse()
    response.read()
    assert response.status == 200
    return conn


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = NaiadProcess(make_repo(tmp_path_factory.mktemp("accept_repo")), "--frontend-workers", "2")
    proc.start()
    wait_for(lambda: len(worker_pids(proc)) == 2, what="two frontend workers")
    yield proc
    code = proc.stop()
    assert code == 0, proc.output()


def test_long_lived_connections_split_evenly(server):
    pids = worker_pids(server)
    settle(server, pids)
    channels = []
    try:
        for _ in range(4):
            c = grpcclient.InferenceServerClient(server.grpc, channel_args=OWN_CONNECTION)
            assert c.is_server_live()
            channels.append(c)
        wait_for(lambda: sum(held(p, server.grpc_port) for p in pids) == 4, 5, "4 channels")
        assert [held(p, server.grpc_port) for p in pids] == [2, 2], server.output()[-3000:]
        inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        for c in channels:  # every channel serves calls on its worker
            out = c.infer("identity_fp32", [inp]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32).reshape(1, 4))
        conns = [keep_alive(server) for _ in range(4)]
        counts = [held(p, server.http_port) for p in pids]
        assert counts == [2, 2]
        assert sorted(owner(pids, c) for c in conns) == sorted(pids * 2)
        for c in conns:
            c.close()
    finally:
        for c in channels:
            c.close()


def test_killed_worker_is_replaced_and_takes_the_next_connections(server):
    pids = worker_pids(server)
    settle(server, pids)
    conns = [keep_alive(server) for _ in range(4)]
    owners = [owner(pids, c) for c in conns]
    assert sorted(owners) == sorted(pids * 2)
    victim = pids[0]
    psutil.Process(victim).send_signal(signal.SIGKILL)
    new = wait_for(lambda: [p for p in worker_pids(server) if p not in pids], 30, "a new worker")[0]
    for c, o in zip(conns, owners):
        if o != victim:  # the survivor's connections still answer
            c.request("GET", "/v2/health/live")
            assert c.getresponse().status == 200
    current = [pids[1], new]
    landed = None
    for _ in range(100):  # until the replacement has registered with the acceptor
        c = keep_alive(server)
        conns.append(c)
        landed = owner(current, c)
        if landed == new:
            break
        time.sleep(0.1)
    assert landed == new, "no connection reached the replacement worker"
    # the replacement holds 1, the survivor 2 or more: the next connection is the replacement's
    assert owner(current, keep_alive(server)) == new
    for c in conns:
        c.close()


def test_tls_through_the_acceptor(tmp_path):
    pki = Pki(tmp_path / "pki", "naiad-accept-ca")
    cert, key = pki.issue("server")
    tls = []
    for endpoint in ("grpc", "http"):
        tls += [
            f"--{endpoint}-server-cert",
            cert,
            f"--{endpoint}-server-key",
            key,
            f"--{endpoint}-use-ssl=true",
        ]
    proc = NaiadProcess(
        make_repo(tmp_path / "repo"), "--frontend-workers", "2", "--allow-metrics", "false", *tls
    )
    proc.start()
    try:
        wait_for(lambda: len(worker_pids(proc)) == 2, what="two frontend workers")
        pids = worker_pids(proc)
        settle(proc, pids)
        context = ssl.create_default_context(cafile=pki.ca)
        conns = []
        for _ in range(2):  # one per worker: both adopt TLS connections
            c = http.client.HTTPSConnection("localhost", proc.http_port, context=context, timeout=10)
            c.request("GET", "/v2/health/ready")
            assert c.getresponse().status == 200
            conns.append(c)
        assert sorted(owner(pids, c) for c in conns) == pids
        r = requests.get(
            f"https://localhost:{proc.http_port}/v2/models/identity_fp32", verify=pki.ca, timeout=10
        )
        assert r.status_code == 200 and r.json()["name"] == "identity_fp32"
        for _ in range(2):
            c = grpcclient.InferenceServerClient(
                f"localhost:{proc.grpc_port}", ssl=True, root_certificates=pki.ca, channel_args=OWN_CONNECTION
            )
            inp = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
            inp.set_data_from_numpy(np.ones((1, 2), np.float32))
            np.testing.assert_array_equal(
                c.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), np.ones((1, 2))
            )
            c.close()
        with pytest.raises(ConnectionError):  # plain HTTP on the TLS port is refused
            c = http.client.HTTPConnection("localhost", proc.http_port, timeout=10)
            c.request("GET", "/v2/health/ready")
            c.getresponse()
        for c in conns:
            c.close()
    finally:
        assert proc.stop() == 0, proc.output()


def listens(pid: int, port: int) -> bool:
    return any(
        c.status == psutil.CONN_LISTEN and c.laddr.port == port
        for c in psutil.Process(pid).net_connections("tcp")
    )


@pytest.mark.parametrize(
    "flags, worker_ports",
    [
        (["--frontend-accept", "reuseport"], ("http", "grpc")),  # every worker binds every port
        (
            ["--grpc-implementation", "grpcio"],
            ("grpc",),
        ),  # grpcio cannot adopt sockets: SO_REUSEPORT for gRPC
    ],
    ids=["reuseport", "grpcio"],
)
def test_who_listens(tmp_path, flags, worker_ports):
    proc = NaiadProcess(make_repo(tmp_path), "--frontend-workers", "2", "--allow-metrics", "false", *flags)
    proc.start()
    try:
        wait_for(lambda: len(worker_pids(proc)) == 2, what="two frontend workers")
        for name, port in (("http", proc.http_port), ("grpc", proc.grpc_port)):
            in_workers = name in worker_ports
            wait_for(  # a worker may still be starting when the first one answers the readiness probe
                lambda port=port, in_workers=in_workers: all(
                    listens(pid, port) == in_workers for pid in worker_pids(proc)
                ),
                what=name,
            )
            assert listens(proc.proc.pid, port) != in_workers, name
        for _ in range(4):
            c = grpcclient.InferenceServerClient(proc.grpc, channel_args=OWN_CONNECTION)
            inp = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
            inp.set_data_from_numpy(np.ones((1, 2), np.float32))
            np.testing.assert_array_equal(
                c.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), np.ones((1, 2))
            )
            c.close()
            keep_alive(proc).close()
    finally:
        assert proc.stop() == 0, proc.output()


def test_pick_fewest_of_the_kind_then_fewest_in_all_then_round_robin(tmp_path):
    acceptor = Acceptor(str(tmp_path))
    a, b = WorkerSlot(None, 1), WorkerSlot(None, 2)  # type: ignore[arg-type]
    a.pid, b.pid = 10, 11
    acceptor.workers = [a, b]

    def hand(kind: bytes) -> WorkerSlot:
        slot = acceptor.pick(kind)[0]
        slot.sent[kind] += 1
        acceptor.handed += 1
        slot.last = acceptor.handed
        return slot

    assert [hand(GRPC).pid for _ in range(4)] == [10, 11, 10, 11]  # ties alternate
    b.received[HTTP], b.open[HTTP] = 0, 5  # b reports 5 open HTTP connections
    assert [hand(GRPC).pid for _ in range(2)] == [10, 11]  # gRPC is balanced by gRPC connections first
    assert hand(HTTP).pid == 10  # HTTP by HTTP connections
    a.received[GRPC], a.open[GRPC] = 3, 0  # a's three gRPC connections closed
    assert [hand(GRPC).pid for _ in range(3)] == [10, 10, 10]
    b.pid = 0  # unregistered (dead, or not yet registered): never picked
    assert [s.pid for s in acceptor.pick(HTTP)] == [10]
