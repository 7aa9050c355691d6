"""Process-isolated python instances (EXECUTION_ISOLATION / the default rule) against a live server.

Each model is served twice, as `<model>_thread` (forced in-process) and `<model>_process` (forced
worker process), so every check compares the two modes on the same server.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from helpers import NaiadProcess

MODELS = Path(__file__).resolve().parent / "models"

RAISER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """KIND selects how execute fails: 1 ValueError, 2 TritonError(NOT_FOUND), 3 TritonModelException,
    4 an error response, 5 too few responses; 0 succeeds."""

    def execute(self, requests):
        kind = int(pb_utils.get_input_tensor_by_name(requests[0], "KIND").as_numpy()[0])
        if kind == 1:
            raise ValueError("value is wrong")
        if kind == 2:
            raise pb_utils.TritonError("no such thing", pb_utils.TritonError.NOT_FOUND)
        if kind == 3:
            raise pb_utils.TritonModelException("model says no")
        if kind == 4:
            return [pb_utils.InferenceResponse(error=pb_utils.TritonError("bad request"))]
        if kind == 5:
            return []
        out = pb_utils.Tensor("OUT", np.array([kind], np.int32))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
'''
RAISER_CONFIG = """
backend: "python"
input [ { name: "KIND" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

REPEAT = '''
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled: N responses OUT=0..N-1 sent from a model thread after execute returned, then FINAL.
    N < 0: one response OUT=pid, then nothing for a minute (to be killed meanwhile)."""

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            threading.Thread(target=self._send, args=(request.get_response_sender(), n), daemon=True).start()
        return None

    def _send(self, sender, n):
        if n < 0:
            pid = pb_utils.Tensor("OUT", np.array([os.getpid()], np.int32))
            sender.send(pb_utils.InferenceResponse([pid]))
            time.sleep(60)
        for i in range(n):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''
REPEAT_CONFIG = """
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

BLS_DECOUPLED = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """BLS on the decoupled model repeat_thread: returns the sum and the count of its responses."""

    def execute(self, requests):
        responses = []
        for request in requests:
            total = count = 0
            call = pb_utils.InferenceRequest(model_name="repeat_thread", requested_output_names=["OUT"],
                                             inputs=[pb_utils.get_input_tensor_by_name(request, "N")])
            for resp in call.exec(decoupled=True):
                if resp.has_error():
                    raise pb_utils.TritonModelException(resp.error().message())
                out = pb_utils.get_output_tensor_by_name(resp, "OUT")
                if out is not None:
                    total += int(out.as_numpy()[0])
                    count += 1
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("TOTAL", np.array([total, count],
                                                                                            np.int32))]))
        return responses
'''
BLS_DECOUPLED_CONFIG = """
backend: "python"
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TOTAL" data_type: TYPE_INT32 dims: [ 2 ] } ]
"""

FINALIZER = '''
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Reports its pid, logs it in initialize; finalize writes it to <model dir>/finalized."""

    def initialize(self, args):
        self.marker = Path(args["model_repository"]) / "finalized"
        pb_utils.Logger.log_warn(f"finalizer worker {os.getpid()} initialized")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])
                for _ in requests]

    def finalize(self):
        self.marker.write_text(str(os.getpid()))
'''
FINALIZER_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""

ISOLATION = 'parameters {{ key: "EXECUTION_ISOLATION" value: {{ string_value: "{}" }} }}\n'


def _config(text: str, name: str, isolation: str | None = None, count: int | None = None) -> str:
    text = re.sub(r'^name: ".*"\n', "", text.lstrip(), flags=re.MULTILINE)
    if count is not None:
        text = re.sub(r"^instance_group .*\n", "", text, flags=re.MULTILINE)
        text += f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n"
    if isolation is not None:
        text += ISOLATION.format(isolation)
    return f'name: "{name}"\n' + text


def copy_model(
    repo: Path, source: str, name: str, isolation: str | None = None, count: int | None = None
) -> None:
    shutil.copytree(MODELS / source, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    config = repo / name / "config.pbtxt"
    config.write_text(_config(config.read_text(), name, isolation, count))


def write_model(repo: Path, name: str, code: str, config: str, isolation: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    (repo / name / "config.pbtxt").write_text(_config(config, name, isolation))


def build_repo(repo: Path) -> Path:
    repo.mkdir(parents=True)
    for mode in ("thread", "process"):
        copy_model(repo, "identity_fp32", f"identity_fp32_{mode}", mode)
        copy_model(repo, "identity_all", f"identity_all_{mode}", mode)
        copy_model(repo, "bls_add_sub", f"bls_add_sub_{mode}", mode)
        copy_model(repo, "bls_missing", f"bls_missing_{mode}", mode)
        copy_model(repo, "broken_init", f"broken_init_{mode}", mode)
        copy_model(repo, "cpu_burn", f"cpu_burn_{mode}", mode, count=1)
        write_model(repo, f"raiser_{mode}", RAISER, RAISER_CONFIG, mode)
        write_model(repo, f"repeat_{mode}", REPEAT, REPEAT_CONFIG, mode)
        write_model(repo, f"bls_decoupled_{mode}", BLS_DECOUPLED, BLS_DECOUPLED_CONFIG, mode)
    copy_model(repo, "add_sub", "add_sub_thread", "thread")
    copy_model(repo, "add_sub", "add_sub")  # count 2: process mode by default (the BLS models call it)
    copy_model(repo, "cpu_burn", "cpu_burn")  # count 2: process mode by default
    copy_model(repo, "cpu_burn", "victim", "process", count=1)
    write_model(repo, "repeat_victim", REPEAT, REPEAT_CONFIG, "process")
    write_model(repo, "finalizer", FINALIZER, FINALIZER_CONFIG, "process")
    return repo


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return build_repo(tmp_path_factory.mktemp("python_process") / "models")


@pytest.fixture(scope="module")
def server(repo):
    proc = NaiadProcess(
        repo,
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        "--strict-readiness",
        "false",
        timeout=180,
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.http, concurrency=4, network_timeout=60)
    yield c
    c.close()


def _fp32(name: str, data: np.ndarray) -> httpclient.InferInput:
    inp = httpclient.InferInput(name, list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    return inp


def _int(name: str, value: int, datatype: str = "INT32", module=httpclient):
    dtype = np.int64 if datatype == "INT64" else np.int32
    inp = module.InferInput(name, [1], datatype)
    inp.set_data_from_numpy(np.array([value], dtype=dtype))
    return inp


def _burn_pid(client, model: str) -> int:
    return int(client.infer(model, [_int("ITERATIONS", 10, "INT64")]).as_numpy("PID")[0])


def _error(client, model: str, inputs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs)
    return info.value


# ---- the choice ----


def test_default_rule_and_parameter():
    from tritonclient.grpc import model_config_pb2 as mc

    from naiad.errors import InvalidArgument
    from naiad.python_isolation import execution_isolation

    def config(count: int, value: str | None = None) -> mc.ModelConfig:
        c = mc.ModelConfig(name="m", backend="python")
        c.instance_group.add(count=count, kind=mc.ModelInstanceGroup.KIND_CPU)
        if value is not None:
            c.parameters["EXECUTION_ISOLATION"].string_value = value
        return c

    assert execution_isolation(config(1)) == "thread"
    assert execution_isolation(config(2)) == "process"
    assert execution_isolation(config(1, "Process")) == "process"
    assert execution_isolation(config(4, "thread")) == "thread"
    with pytest.raises(InvalidArgument, match="EXECUTION_ISOLATION"):
        execution_isolation(config(1, "fiber"))


def test_modes_run_where_they_should(server, client):
    assert _burn_pid(client, "cpu_burn_thread") == server.proc.pid
    assert _burn_pid(client, "cpu_burn_process") != server.proc.pid
    calls = [client.async_infer("cpu_burn", [_int("ITERATIONS", 300_000, "INT64")]) for _ in range(8)]
    pids = {int(c.get_result().as_numpy("PID")[0]) for c in calls}
    assert server.proc.pid not in pids and len(pids) == 2  # the default for count 2: two workers


# ---- same results in both modes ----


@pytest.mark.parametrize("model", ["identity_fp32_thread", "identity_fp32_process"])
def test_identity_small_and_large(client, model):
    for data in (
        np.arange(4, dtype=np.float32).reshape(1, 4),
        np.random.default_rng(0).random((2, 1_000_000), dtype=np.float32),
    ):  # 8 MB: out of band
        got = client.infer(model, [_fp32("INPUT0", data)]).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(got, data)


ALL_TYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "STRING": np.object_,
}


def sample(dtype, n: int = 5) -> np.ndarray:
    if dtype is np.object_:
        return np.array([f"s{i}".encode() for i in range(n)], dtype=np.object_)
    if dtype is np.bool_:
        return np.array([i % 2 == 0 for i in range(n)])
    return (np.arange(n) + 1).astype(dtype)


def test_every_datatype_is_the_same_in_both_modes(client):
    results = {}
    for mode in ("thread", "process"):
        inputs, outputs = [], []
        for name, dtype in ALL_TYPES.items():
            data = sample(dtype)
            inp = httpclient.InferInput(
                f"IN_{name}",
                list(data.shape),
                "BYTES" if dtype is np.object_ else np_to_triton_dtype(data.dtype),
            )
            inp.set_data_from_numpy(data)
            inputs.append(inp)
            outputs.append(httpclient.InferRequestedOutput(f"OUT_{name}"))
        result = client.infer(f"identity_all_{mode}", inputs, outputs=outputs)
        results[mode] = {n: result.as_numpy(f"OUT_{n}") for n in ALL_TYPES}
    for name in ALL_TYPES:
        np.testing.assert_array_equal(results["process"][name], results["thread"][name])
        assert results["process"][name].dtype == results["thread"][name].dtype


def test_bf16_in_process_mode(server):
    words = np.array([0x3F80, 0x4000, 0xC040], dtype=np.uint16)
    header = json.dumps(
        {
            "inputs": [
                {"name": "IN_BF16", "shape": [3], "datatype": "BF16", "parameters": {"binary_data_size": 6}}
            ],
            "outputs": [{"name": "OUT_BF16", "parameters": {"binary_data": True}}],
        }
    ).encode()
    r = requests.post(
        f"{server.url}/v2/models/identity_all_process/infer",
        data=header + words.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    assert json.loads(r.content[:n])["outputs"][0]["datatype"] == "BF16"
    assert np.frombuffer(r.content[n:], dtype=np.uint16).tolist() == words.tolist()


def test_add_sub_same_in_both_modes(server, client):
    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 0.5, dtype=np.float32)
    results = {}
    for model in ("add_sub_thread", "add_sub"):
        r = client.infer(
            model,
            [_fp32("INPUT0", a), _fp32("INPUT1", b)],
            request_id="r-1",
            outputs=[httpclient.InferRequestedOutput("OUTPUT1")],
        )
        assert r.get_response()["id"] == "r-1"
        assert r.as_numpy("OUTPUT0") is None  # only the requested output comes back
        results[model] = r.as_numpy("OUTPUT1")
    np.testing.assert_array_equal(results["add_sub"], a - b)
    np.testing.assert_array_equal(results["add_sub"], results["add_sub_thread"])
    g = grpcclient.InferenceServerClient(server.grpc)
    try:
        inputs = [grpcclient.InferInput("INPUT0", [4], "FP32"), grpcclient.InferInput("INPUT1", [4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        np.testing.assert_array_equal(g.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + b)
    finally:
        g.close()


# ---- BLS from a worker ----


def test_bls_sync_and_async_from_a_worker(client):
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    b = np.array([5, 6, 7, 8], dtype=np.float32)
    got = client.infer("bls_add_sub_process", [_fp32("INPUT0", a), _fp32("INPUT1", b)]).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(got, 2 * a)


def test_bls_error_text_is_the_same(client):
    texts = {}
    for mode in ("thread", "process"):
        inputs = [_fp32("INPUT0", np.zeros(4, np.float32))]
        texts[mode] = _error(client, f"bls_missing_{mode}", inputs).message()
    assert "BLS failed:" in texts["process"] and "no_such_model" in texts["process"]
    assert texts["process"] == texts["thread"]


def test_decoupled_bls_from_a_worker(client):
    for mode in ("thread", "process"):
        got = client.infer(f"bls_decoupled_{mode}", [_int("N", 5)]).as_numpy("TOTAL").tolist()
        assert got == [0 + 1 + 2 + 3 + 4, 5], mode


# ---- errors ----


@pytest.mark.parametrize("kind", [1, 2, 3, 4, 5])
def test_execute_errors_are_the_same_in_both_modes(client, kind):
    errors = {mode: _error(client, f"raiser_{mode}", [_int("KIND", kind)]) for mode in ("thread", "process")}
    thread, process = errors["thread"], errors["process"]
    assert process.status() == thread.status()
    assert process.message().replace("raiser_process", "raiser") == thread.message().replace(
        "raiser_thread", "raiser"
    )
    assert client.infer("raiser_process", [_int("KIND", 0)]).as_numpy("OUT").tolist() == [0]


def test_initialize_failure_fails_the_load_cleanly(client):
    assert not client.is_model_ready("broken_init_process")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    reason = index["broken_init_process"]["reason"]
    assert reason.replace("_process", "") == index["broken_init_thread"]["reason"].replace("_thread", "")
    assert "initialize failed: RuntimeError: this model is broken on purpose" in reason
    with pytest.raises(InferenceServerException, match="broken_init_process"):
        client.load_model("broken_init_process")


# ---- decoupled ----


def _stream(server, model: str, n: int) -> list:
    client = grpcclient.InferenceServerClient(server.grpc)
    results: list = []
    done = threading.Event()

    def callback(result, error):
        results.append(error if error is not None else result)
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(model, [_int("N", n, module=grpcclient)], enable_empty_final_response=True)
        assert done.wait(30), f"no final response from {model}"
    finally:
        client.stop_stream()
        client.close()
    return results


def test_decoupled_responses_after_execute_returned(server):
    outputs = {}
    for mode in ("thread", "process"):
        results = _stream(server, f"repeat_{mode}", 4)
        assert not [r for r in results if isinstance(r, Exception)]
        outputs[mode] = [None if r.as_numpy("OUT") is None else r.as_numpy("OUT").tolist() for r in results]
    assert outputs["process"] == outputs["thread"] == [[0], [1], [2], [3], None]


# ---- a worker that dies ----


def test_killed_worker_ends_open_decoupled_streams(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    results: list = []
    first, done = threading.Event(), threading.Event()

    def callback(result, error):
        results.append(error if error is not None else result)
        first.set()
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(
            "repeat_victim", [_int("N", -1, module=grpcclient)], enable_empty_final_response=True
        )
        assert first.wait(30)
        pid = int(results[0].as_numpy("OUT")[0])
        assert pid != server.proc.pid
        os.kill(pid, signal.SIGKILL)
        assert done.wait(30), "the stream hangs after its worker died"
    finally:
        client.stop_stream()
        client.close()
    assert isinstance(results[-1], InferenceServerException)
    assert "exited unexpectedly" in results[-1].message() and str(pid) in results[-1].message()


def test_killed_worker_fails_in_flight_request_then_comes_back(server, client):
    from naiad.backends.python.process import SHORT_LIFE_S

    pid = _burn_pid(client, "victim")
    assert pid != server.proc.pid
    # A worker that dies younger than SHORT_LIFE_S is restarted after a back-off during which requests fail at
    # once (test_python_restart covers that); this test is about the plain restart, so the worker must be older.
    time.sleep(SHORT_LIFE_S)
    result: dict = {}

    def long_call():
        # tritonclient.http runs on gevent: one client per thread
        own = httpclient.InferenceServerClient(server.http, network_timeout=60)
        try:
            own.infer("victim", [_int("ITERATIONS", 500_000_000, "INT64")])
        except InferenceServerException as exc:
            result["error"] = exc
        finally:
            own.close()

    caller = threading.Thread(target=long_call)
    caller.start()
    time.sleep(1.0)  # the request is executing in the worker
    os.kill(pid, signal.SIGKILL)
    caller.join(30)
    assert not caller.is_alive(), "the in-flight request hangs after its worker died"
    message = result["error"].message()
    assert "exited unexpectedly" in message and "SIGKILL" in message and str(pid) in message
    assert "being restarted" in message
    # the instance comes back by itself: a later request waits for the new worker and succeeds there
    assert _burn_pid(client, "victim") not in (pid, server.proc.pid)
    assert client.is_model_ready("victim")
    # everything else was served all along
    data = np.ones((1, 3), dtype=np.float32)
    np.testing.assert_array_equal(
        client.infer("identity_fp32_process", [_fp32("INPUT0", data)]).as_numpy("OUTPUT0"), data
    )
    assert _burn_pid(client, "cpu_burn_process") != pid
    # and reloading the model still starts a new worker
    before = _burn_pid(client, "victim")
    client.load_model("victim")
    assert _burn_pid(client, "victim") not in (pid, before, server.proc.pid)


def test_worker_logs_reach_the_server_log(server, client):
    pid = int(client.infer("finalizer", [_int("X", 0)]).as_numpy("PID")[0])
    assert f"finalizer worker {pid} initialized" in server.output()


def test_unload_calls_finalize_in_the_worker_and_reaps_it(client, repo):
    pid = int(client.infer("finalizer", [_int("X", 0)]).as_numpy("PID")[0])
    client.unload_model("finalizer")
    deadline = time.monotonic() + 30
    while client.is_model_ready("finalizer") and time.monotonic() < deadline:
        time.sleep(0.1)
    marker = repo / "finalizer" / "finalized"
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.read_text() == str(pid)
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text()
    except OSError:
        return False


# ---- several cores ----


def _spin(iterations: int) -> int:
    """cpu_burn's loop, for plain processes to compare with."""
    total = 0
    for i in range(iterations):
        total = (total + i * i) % 1000003
    return total


def test_two_process_instances_use_two_cores(client):
    """count 2 in process mode: 2 concurrent requests take clearly less than twice one request.

    Other work may load this 2-core machine in bursts, so single and concurrent runs are interleaved and
    the quickest of each is compared (the least disturbed), for up to a minute. Two plain processes running the
    same loop are measured alongside: when even they never ran in parallel, the machine was too busy to tell."""
    iterations = 600_000
    burn = [_int("ITERATIONS", iterations, "INT64")]

    def served(n: int) -> float:
        t = time.perf_counter()
        for call in [client.async_infer("cpu_burn", burn) for _ in range(n)]:
            call.get_result()
        return time.perf_counter() - t

    def plain(pool, n: int) -> float:
        t = time.perf_counter()
        for call in [pool.apply_async(_spin, (iterations,)) for _ in range(n)]:
            call.get()
        return time.perf_counter() - t

    singles, pairs, plain_singles, plain_pairs = [], [], [], []
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_spin, [10, 10])
        # until the quickest pair shows the two instances in parallel, for up to a minute: a burst of other work
        # (a CI run once kept the second core busy for the whole 20 attempts this loop used to make) passes
        deadline = time.monotonic() + 60
        for attempt in itertools.count():
            singles.append(served(1))
            pairs.append(served(2))
            plain_singles.append(plain(pool, 1))
            plain_pairs.append(plain(pool, 2))
            if (attempt >= 2 and min(pairs) / min(singles) < 1.6) or time.monotonic() > deadline:
                break
    ratio = min(pairs) / min(singles)
    machine = min(plain_pairs) / min(plain_singles)
    detail = (  # the last 20 attempts of len(singles)
        f"{len(singles)} attempts; the last: single: {[round(t, 3) for t in singles[-20:]]}, pairs: "
        f"{[round(t, 3) for t in pairs[-20:]]}; plain processes: {[round(t, 3) for t in plain_singles[-20:]]}, "
        f"{[round(t, 3) for t in plain_pairs[-20:]]}"
    )
    if ratio >= 1.6 and machine >= 1.5:
        pytest.skip(f"two plain processes took {machine:.2f}x one: the machine is too busy to tell; {detail}")
    assert ratio < 1.6, f"2 concurrent requests took {ratio:.2f}x one ({machine:.2f}x plain); {detail}"
