"""`naiad serve --frontend-workers 2`: every protocol through worker processes in front of one engine process,
statistics counted once for all workers, a killed worker replaced, the engine's death ending the server."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import shutil
import signal
import time
import uuid

import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from helpers import ROOT, NaiadProcess
from tritonclient.utils import InferenceServerException

from naiad.engine.slabs import SHM_DIR

MODELS = ROOT / "tests" / "models"
WORKER_MODULE = "naiad.engine.worker"


def make_repo(path):
    for name in ("identity_fp32", "repeat", "seq_accumulator"):
        shutil.copytree(MODELS / name, path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (path / "batched" / "1").mkdir(parents=True)  # dynamic batching, 300 ms queue delay; BATCH = batch size
    shutil.copy(MODELS / "batched" / "config.pbtxt", path / "batched" / "config.pbtxt")
    shutil.copy(MODELS / "batch_probe.py", path / "batched" / "1" / "model.py")
    return path


def connection_owner(server, conn: http.client.HTTPConnection, pids: list[int]) -> int | None:
    """The worker that accepted a connection (by the client's port among the workers' sockets)."""
    port = conn.sock.getsockname()[1]
    for pid in pids:
        if any(c.raddr and c.raddr.port == port for c in psutil.Process(pid).net_connections("tcp")):
            return pid
    return None


def worker_pids(server: NaiadProcess) -> list[int]:
    try:
        children = psutil.Process(server.proc.pid).children()
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            if WORKER_MODULE in " ".join(child.cmdline()):
                out.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(out)


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = make_repo(tmp_path_factory.mktemp("workers_repo"))
    proc = NaiadProcess(
        repo, "--frontend-workers", "2", "--model-control-mode", "explicit", "--load-model", "*"
    )
    proc.start()
    wait_for(lambda: len(worker_pids(proc)) == 2, what="two frontend workers")
    yield proc
    code = proc.stop()
    assert code == 0, proc.output()


def fresh_http(server) -> httpclient.InferenceServerClient:
    """A client with its own connection: with SO_REUSEPORT the kernel picks the worker per connection."""
    return httpclient.InferenceServerClient(server.http)


def identity_inputs(module, data: np.ndarray, binary: bool = True):
    inp = module.InferInput("INPUT0", list(data.shape), "FP32")
    if module is httpclient:
        inp.set_data_from_numpy(data, binary_data=binary)
    else:
        inp.set_data_from_numpy(data)
    return [inp]


def test_both_workers_accept_connections(server):
    """Connections held open at once land on both workers: the balanced acceptor gives the second one to the
    worker without a connection. (Closing each before the next made the test depend on whether the server had
    counted the close yet: both workers at 0 again means a tie, and the tie always went to the first.)"""
    pids = set(worker_pids(server))
    seen = set()
    conns = []
    try:
        for _ in range(40):
            conn = http.client.HTTPConnection(*server.http.split(":"))
            conns.append(conn)
            conn.request("GET", "/v2/health/ready")
            assert conn.getresponse().status == 200
            port = conn.sock.getsockname()[1]
            for pid in pids:
                if any(c.raddr and c.raddr.port == port for c in psutil.Process(pid).net_connections("tcp")):
                    seen.add(pid)
            if seen == pids:
                break
    finally:
        for conn in conns:
            conn.close()
    assert seen == pids


def test_health_and_metadata_same_everywhere(server):
    answers = set()
    for _ in range(6):
        c = fresh_http(server)
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("identity_fp32")
        md = c.get_model_metadata("identity_fp32")
        answers.add((md["name"], tuple(md["versions"]), md["inputs"][0]["datatype"]))
        c.close()
        g = grpcclient.InferenceServerClient(server.grpc)
        assert g.is_server_ready() and g.get_server_metadata().name == "naiad"
        assert g.get_model_config("identity_fp32").config.max_batch_size == 8
        g.close()
    assert answers == {("identity_fp32", ("1",), "FP32")}
    bad = requests.get(f"{server.url}/v2/models/nonexistent/config")
    assert bad.status_code >= 400 and "error" in bad.json()


@pytest.mark.parametrize("protocol", ["http-json", "http-binary", "grpc"])
def test_infer(server, protocol):
    data = np.arange(12, dtype=np.float32).reshape(1, 12)
    if protocol == "grpc":
        client = grpcclient.InferenceServerClient(server.grpc)
        result = client.infer("identity_fp32", identity_inputs(grpcclient, data))
    else:
        client = fresh_http(server)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=protocol == "http-binary")]
        result = client.infer(
            "identity_fp32", identity_inputs(httpclient, data, protocol == "http-binary"), outputs=outputs
        )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_large_tensor_byte_for_byte(server, protocol):
    rng = np.random.default_rng(7)
    data = rng.integers(0, 2**32, size=(1, 4 * 1024 * 1024), dtype=np.uint32).view(np.float32)  # 16 MiB
    if protocol == "grpc":
        client = grpcclient.InferenceServerClient(server.grpc)
        got = client.infer("identity_fp32", identity_inputs(grpcclient, data)).as_numpy("OUTPUT0")
    else:
        client = fresh_http(server)
        got = client.infer("identity_fp32", identity_inputs(httpclient, data)).as_numpy("OUTPUT0")
    assert got.shape == data.shape and got.tobytes() == data.tobytes()
    client.close()
    # the body landed in a shared receive buffer the engine read in place: no slab was filled with a copy
    segments = [
        n for pid in worker_pids(server) for n in os.listdir(SHM_DIR) if n.startswith(f"naiad-w{pid}-")
    ]
    copies = [
        n for n in segments if "-r" not in n and os.path.getsize(os.path.join(SHM_DIR, n)) >= data.nbytes
    ]
    assert copies == [] and any("-r" in n for n in segments), segments


def test_system_shared_memory_across_workers(server):
    key = f"/naiad_workers_{uuid.uuid4().hex[:8]}"
    data = np.arange(16, dtype=np.float32).reshape(1, 16)
    region = shm.create_shared_memory_region("in_out", key, 2 * data.nbytes)
    try:
        shm.set_shared_memory_region(region, [data])
        first = fresh_http(server)
        first.register_system_shared_memory("in_out", key, 2 * data.nbytes)
        for _ in range(4):  # other connections, so other workers, see the registration
            c = fresh_http(server)
            assert [r["name"] for r in c.get_system_shared_memory_status()] == ["in_out"]
            inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_shared_memory("in_out", data.nbytes)
            out = httpclient.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory("in_out", data.nbytes, offset=data.nbytes)
            c.infer("identity_fp32", [inp], outputs=[out])
            got = shm.get_contents_as_numpy(region, np.float32, [1, 16], offset=data.nbytes)
            np.testing.assert_array_equal(got, data)
            g = grpcclient.InferenceServerClient(server.grpc)
            assert [r for r in g.get_system_shared_memory_status().regions] == ["in_out"]
            g.close()
            c.close()
        first.unregister_system_shared_memory("in_out")
        assert fresh_http(server).get_system_shared_memory_status() == []
    finally:
        shm.destroy_shared_memory_region(region)


def test_decoupled_stream_in_order(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    ins = [grpcclient.InferInput("IN", [1], "INT32"), grpcclient.InferInput("COUNT", [1], "INT32")]
    ins[0].set_data_from_numpy(np.array([5], np.int32))
    ins[1].set_data_from_numpy(np.array([20], np.int32))
    client.async_stream_infer("repeat", ins, request_id="r")
    client.stop_stream()
    got = []
    while not results.empty():
        result, error = results.get()
        assert error is None, str(error)
        got.append(int(result.as_numpy("IDX")[0]))
    assert got == list(range(20))
    client.close()
    sse = requests.post(
        f"{server.url}/v2/models/repeat/generate_stream", json={"IN": 3, "COUNT": 4}, stream=True, timeout=30
    )
    events = [line for line in sse.iter_lines() if line.startswith(b"data: ")]
    assert len(events) == 4


def test_sequence_over_many_connections(server):
    total = 0
    for i, value in enumerate([3, 5, 7, 11]):
        client = fresh_http(server)  # a new connection per request: the sequence crosses workers
        inp = httpclient.InferInput("INPUT", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[value]], np.int32))
        result = client.infer(
            "seq_accumulator", [inp], sequence_id=4242, sequence_start=i == 0, sequence_end=i == 3
        )
        total += value
        assert int(result.as_numpy("OUTPUT").reshape(-1)[0]) == total
        client.close()


def test_model_control_seen_by_every_worker(server):
    fresh_http(server).unload_model("repeat")
    for _ in range(4):
        c = fresh_http(server)
        assert not c.is_model_ready("repeat")
        c.close()
    index = {m["name"]: m.get("state") for m in fresh_http(server).get_model_repository_index()}
    assert index["repeat"] == "UNAVAILABLE"
    g = grpcclient.InferenceServerClient(server.grpc)
    g.load_model("repeat")
    g.close()
    for _ in range(4):
        c = fresh_http(server)
        assert c.is_model_ready("repeat")
        c.close()


def test_statistics_count_every_worker(server):
    def count():
        stats = fresh_http(server).get_inference_statistics("identity_fp32")["model_stats"][0]
        return stats["inference_stats"]["success"]["count"]

    before = count()
    data = np.ones((1, 4), np.float32)
    k = 24
    for i in range(k):
        if i % 2:
            c = grpcclient.InferenceServerClient(server.grpc)
            c.infer("identity_fp32", identity_inputs(grpcclient, data))
        else:
            c = fresh_http(server)
            c.infer("identity_fp32", identity_inputs(httpclient, data))
        c.close()
    assert count() - before == k
    metrics = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
    line = next(
        ln
        for ln in metrics.splitlines()
        if ln.startswith("nv_inference_request_success{") and 'model="identity_fp32"' in ln
    )
    assert float(line.rsplit(" ", 1)[1]) >= k


def test_logging_and_trace_settings_same_everywhere(server):
    fresh_http(server).update_log_settings({"log_verbose_level": 1})
    g = grpcclient.InferenceServerClient(server.grpc)
    assert g.get_log_settings(as_json=True)["settings"]["log_verbose_level"]["uint32_param"] == 1
    g.close()
    fresh_http(server).update_log_settings({"log_verbose_level": 0})
    assert fresh_http(server).get_log_settings()["log_verbose_level"] == 0
    assert "trace_level" in fresh_http(server).get_trace_settings()


def test_killed_worker_is_replaced(server):
    pids = worker_pids(server)
    assert len(pids) == 2
    conns = []
    for _ in range(30):  # keep-alive connections, until both workers hold at least one
        conn = http.client.HTTPConnection(*server.http.split(":"), timeout=10)
        conn.request("GET", "/v2/health/live")
        conn.getresponse().read()
        port = conn.sock.getsockname()[1]
        owner = next(
            pid
            for pid in pids
            if any(c.raddr and c.raddr.port == port for c in psutil.Process(pid).net_connections("tcp"))
        )
        conns.append((owner, conn))
        if {o for o, _ in conns} == set(pids):
            break
    victim, survivor = pids[0], pids[1]
    psutil.Process(victim).send_signal(signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie", 10)
    for owner, conn in conns:
        if owner == survivor:  # the same connection, not a new one, still answers
            conn.request("GET", "/v2/health/ready")
            assert conn.getresponse().status == 200
        conn.close()
    new = wait_for(lambda: [p for p in worker_pids(server) if p not in pids], 30, "a new worker")
    assert len(worker_pids(server)) == 2 and new
    for _ in range(6):
        c = fresh_http(server)
        np.testing.assert_array_equal(
            c.infer("identity_fp32", identity_inputs(httpclient, np.ones((1, 2), np.float32))).as_numpy(
                "OUTPUT0"
            ),
            np.ones((1, 2), np.float32),
        )
        c.close()


def test_engine_death_ends_the_server(tmp_path):
    repo = make_repo(tmp_path / "repo")
    proc = NaiadProcess(repo, "--frontend-workers", "2", "--model-control-mode", "explicit")
    proc.start()
    workers: list[int] = []
    try:
        workers = wait_for(lambda: worker_pids(proc) if len(worker_pids(proc)) == 2 else None, 20)
        proc.proc.send_signal(signal.SIGKILL)
        assert proc.proc.wait(10) != 0
        wait_for(lambda: not any(_running(p) for p in workers), 15, "the workers to exit")
    finally:
        proc.stop()
        for pid in workers:
            if _running(pid):
                psutil.Process(pid).kill()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_frontend_workers_auto_reads_the_cgroup_quota(tmp_path):
    from naiad import cpus

    online = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpus.quota_cpus(str(tmp_path)) == 1.5
    assert cpus.pod_cpus(str(tmp_path)) == min(2, online)
    assert cpus.auto_workers(str(tmp_path)) == 1  # 2 CPUs: one process
    (tmp_path / "cpu.max").write_text("400000 100000\n")
    assert cpus.auto_workers(str(tmp_path)) == max(1, min(4, online) - 1)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpus.quota_cpus(str(tmp_path)) is None and cpus.pod_cpus(str(tmp_path)) is None
    assert cpus.auto_workers(str(tmp_path)) == 1  # no limit: the host's CPUs are not the pod's
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpus.quota_cpus(str(tmp_path)) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.auto_workers(str(tmp_path)) == 1
    with pytest.raises(argparse.ArgumentTypeError):
        cpus.frontend_workers("0")
    with pytest.raises(argparse.ArgumentTypeError):
        cpus.frontend_workers("many")
    assert cpus.frontend_workers("3") == 3
    from naiad.cli import build_parser  # the default follows the pod's CPU limit

    assert (
        build_parser().parse_args(["serve", "--model-repository", "m"]).frontend_workers
        == cpus.auto_workers()
    )


def test_errors_come_back_as_the_single_process_sends_them(server):
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    answer = requests.post(f"{server.url}/v2/models/no_such_model/infer", json=body, timeout=10)
    assert answer.status_code in (400, 404) and "no_such_model" in answer.json()["error"]
    wrong = {"inputs": [{"name": "WRONG", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    answer = requests.post(f"{server.url}/v2/models/identity_fp32/infer", json=wrong, timeout=10)
    assert answer.status_code == 400 and "WRONG" in answer.json()["error"]
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException, match="no_such_model"):
        client.infer("no_such_model", identity_inputs(grpcclient, np.ones((1, 2), np.float32)))
    client.close()


def test_dynamic_batching_batches_across_workers(server):
    pids = worker_pids(server)
    per_worker: dict[int, list] = {pid: [] for pid in pids}
    for _ in range(60):  # four keep-alive connections on each worker
        conn = http.client.HTTPConnection(*server.http.split(":"), timeout=30)
        conn.request("GET", "/v2/health/live")
        conn.getresponse().read()
        owner = connection_owner(server, conn, pids)
        if owner is not None and len(per_worker[owner]) < 4:
            per_worker[owner].append(conn)
        else:
            conn.close()
        if all(len(c) == 4 for c in per_worker.values()):
            break
    conns = [c for cs in per_worker.values() for c in cs]
    assert len(conns) == 8, {pid: len(c) for pid, c in per_worker.items()}
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}
    ).encode()
    for conn in conns:  # all eight within the 300 ms queue delay
        conn.request("POST", "/v2/models/batched/infer", body, {"Content-Type": "application/json"})
    batches = []
    for conn in conns:
        answer = conn.getresponse()
        assert answer.status == 200
        outputs = {o["name"]: o["data"] for o in json.loads(answer.read())["outputs"]}
        batches.append(outputs["BATCH"][0])
        conn.close()
    assert max(batches) > 4, batches  # one execution held requests from both workers


def test_a_request_whose_deadline_passes_in_the_queue_is_not_executed(server):
    """A gRPC deadline that passes while the request waits in the engine's queue (the `batched` model holds a
    request 300 ms for a batch) cancels it there, as in one process: the model never executes it."""

    def counts():
        stats = fresh_http(server).get_inference_statistics("batched")["model_stats"][0]
        return stats["inference_count"], stats["execution_count"]

    before = counts()
    client = grpcclient.InferenceServerClient(server.grpc)
    inp = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
    inp.set_data_from_numpy(np.ones((1, 1), np.float32))
    with pytest.raises(InferenceServerException, match="Deadline"):
        client.infer("batched", [inp], client_timeout=0.1)
    time.sleep(0.6)  # past the queue delay: an execution of it would have happened by now
    assert counts() == before
    answer = client.infer("batched", [inp])  # the model goes on serving
    assert answer.as_numpy("BATCH")[0, 0] == 1
    client.close()
    assert counts() == (before[0] + 1, before[1] + 1)
