"""Sequence batcher (stateful models) through tritonclient against a real `naiad serve` process.

The repository is built in a tmp dir from `tests/models/seq_accumulator` (a python accumulator keyed by
the CORRID control, which also checks every control it gets) and `tests/models/seq_state` (implicit
state), with config variants written here: strategies, CORRID types, slots, idle timeouts.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from helpers import NaiadProcess
from tritonclient.utils import InferenceServerException

MODELS = Path(__file__).resolve().parent / "models"

CONTROLS = """
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {corrid} }} ] }}
  ]
"""


def accumulator_config(
    name,
    *,
    strategy="direct { }",
    corrid="TYPE_UINT64",
    max_batch_size=4,
    count=2,
    idle_us=5_000_000,
    delay_ms=0,
    controls=None,
):
    return f"""
name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  {controls if controls is not None else CONTROLS.format(corrid=corrid)}
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
parameters {{ key: "delay_ms" value {{ string_value: "{delay_ms}" }} }}
"""


OLDEST = (
    "oldest { max_candidate_sequences: 4 preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 20000 }"
)

ACCUMULATORS = {
    "seq_acc_direct_u64": dict(),
    "seq_acc_direct_str": dict(corrid="TYPE_STRING"),
    "seq_acc_oldest_u64": dict(strategy=OLDEST),
    "seq_acc_oldest_str": dict(strategy=OLDEST, corrid="TYPE_STRING"),
    # one instance, slow executions: concurrent sequences must share batches
    "seq_acc_stats_direct": dict(count=1, delay_ms=50),
    "seq_acc_stats_oldest": dict(count=1, delay_ms=50, strategy=OLDEST),
    # one slot in all
    "seq_acc_idle": dict(count=1, max_batch_size=0, idle_us=300_000),
    "seq_acc_backlog": dict(count=1, max_batch_size=0),
    # a CORRID-only model without batching (controls of shape [1])
    "seq_acc_unbatched": dict(max_batch_size=0, count=1),
    "seq_bad_control": dict(
        controls="""control_input [
        { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1, 2 ] } ] } ]"""
    ),
}

STATE_FILE_CONFIG = """
name: "seq_state_file"
backend: "python"
max_batch_size: 2
sequence_batching {
  oldest { max_candidate_sequences: 2 }
  state [
    {
      input_name: "INPUT_STATE"
      output_name: "OUTPUT_STATE"
      data_type: TYPE_INT32
      dims: [ 1 ]
      initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "hundred" name: "from file" }
    }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("seqrepo")
    for name, options in ACCUMULATORS.items():
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(MODELS / "seq_accumulator" / "1" / "model.py", repo / name / "1" / "model.py")
        (repo / name / "config.pbtxt").write_text(accumulator_config(name, **options))
    shutil.copytree(MODELS / "seq_state", repo / "seq_state", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "seq_state_file" / "1").mkdir(parents=True)
    shutil.copy(MODELS / "seq_state" / "1" / "model.py", repo / "seq_state_file" / "1" / "model.py")
    (repo / "seq_state_file" / "config.pbtxt").write_text(STATE_FILE_CONFIG)
    (repo / "seq_state_file" / "initial_state").mkdir()
    (repo / "seq_state_file" / "initial_state" / "hundred").write_bytes(np.array([100], np.int32).tobytes())
    proc = NaiadProcess(repo, "--strict-readiness", "false")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def grpc_client(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http_client(server):
    client = httpclient.InferenceServerClient(server.http)
    yield client
    client.close()


def infer(client, model, value, sequence_id=0, start=False, end=False, batched=True, outputs=None):
    """One request; returns OUTPUT as an int and the names of the outputs the server sent."""
    mod = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    data = np.array([[value]] if batched else [value], dtype=np.int32)
    inp = mod.InferInput("INPUT", list(data.shape), "INT32")
    inp.set_data_from_numpy(data)
    requested = [mod.InferRequestedOutput(n) for n in outputs] if outputs else None
    result = client.infer(
        model, [inp], outputs=requested, sequence_id=sequence_id, sequence_start=start, sequence_end=end
    )
    if mod is grpcclient:
        names = [o.name for o in result.get_response().outputs]
    else:
        names = [o["name"] for o in result.get_response()["outputs"]]
    return int(result.as_numpy("OUTPUT").reshape(-1)[0]), names


def run_sequence(server, model, sequence_id, values, offset, batched=True):
    """Send one sequence, alternating HTTP and gRPC per request; return the running sums received."""
    http = httpclient.InferenceServerClient(server.http)
    grpc = grpcclient.InferenceServerClient(server.grpc)
    rng = random.Random(str(sequence_id))
    sums = []
    try:
        for i, value in enumerate(values):
            client = (http, grpc)[(i + offset) % 2]
            out, _ = infer(
                client, model, value, sequence_id, start=i == 0, end=i == len(values) - 1, batched=batched
            )
            sums.append(out)
            time.sleep(rng.uniform(0, 0.01))
    finally:
        http.close()
        grpc.close()
    return sums


def stats_of(server, model):
    return requests.get(f"{server.url}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]


@pytest.mark.parametrize("strategy", ["direct", "oldest"])
def test_interleaved_sequences_keep_their_own_sums(server, strategy):
    rng = random.Random(strategy)
    jobs = []
    for k in range(6):
        jobs.append((f"seq_acc_{strategy}_u64", 1000 + k + (0 if strategy == "direct" else 100)))
        jobs.append((f"seq_acc_{strategy}_str", f"{strategy}-{k}-{uuid.uuid4().hex[:8]}"))
    jobs.append((f"seq_acc_{strategy}_u64", 2**63 - 1 - (strategy == "oldest")))  # largest id gRPC can send
    plans = [(model, sid, [rng.randint(1, 9) for _ in range(rng.randint(4, 9))]) for model, sid in jobs]
    with ThreadPoolExecutor(len(plans)) as pool:
        futures = [
            pool.submit(run_sequence, server, model, sid, values, n)
            for n, (model, sid, values) in enumerate(plans)
        ]
        for (model, sid, values), fut in zip(plans, futures):
            assert fut.result(timeout=60) == list(np.cumsum(values)), (model, sid)
    for model in (f"seq_acc_{strategy}_u64", f"seq_acc_{strategy}_str"):
        stats = stats_of(server, model)
        expected = sum(len(v) for m, _, v in plans if m == model)
        assert stats["inference_stats"]["success"]["count"] == expected
        assert stats["inference_stats"]["fail"]["count"] == 0


def test_unbatched_model_gets_rank1_controls(server, grpc_client):
    seq = 77
    assert [
        infer(grpc_client, "seq_acc_unbatched", v, seq, start=i == 0, end=i == 2, batched=False)[0]
        for i, v in enumerate([5, 6, 7])
    ] == [5, 11, 18]


def test_uint64_id_beyond_int64_over_http(server, http_client):
    sid = 2**64 - 3
    assert infer(http_client, "seq_acc_direct_u64", 4, sid, start=True)[0] == 4
    assert infer(http_client, "seq_acc_direct_u64", 5, sid, end=True)[0] == 9


def test_same_number_as_int_and_string_are_different_sequences(server, http_client):
    assert infer(http_client, "seq_acc_direct_str", 1, 31, start=True)[0] == 1
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        infer(http_client, "seq_acc_direct_str", 1, "31")
    infer(http_client, "seq_acc_direct_str", 1, 31, end=True)


def test_unknown_sequence_is_rejected(server, http_client, grpc_client):
    msg = (
        "inference request for sequence {} to model '{}' must specify the START flag on the first request "
        "of the sequence"
    )
    with pytest.raises(InferenceServerException) as e:
        infer(http_client, "seq_acc_direct_u64", 1, 424242)
    assert e.value.message() == msg.format(424242, "seq_acc_direct_u64")
    assert e.value.status() == "400"
    with pytest.raises(InferenceServerException) as e:
        infer(grpc_client, "seq_acc_oldest_str", 1, "no-such-seq")
    assert e.value.message() == msg.format("no-such-seq", "seq_acc_oldest_str")
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    # a sequence that ended is unknown again
    infer(grpc_client, "seq_acc_direct_u64", 1, 5150, start=True, end=True)
    with pytest.raises(InferenceServerException) as e:
        infer(grpc_client, "seq_acc_direct_u64", 1, 5150)
    assert e.value.message() == msg.format(5150, "seq_acc_direct_u64")


def test_missing_correlation_id_is_rejected(server, http_client, grpc_client):
    for client in (http_client, grpc_client):
        for start in (False, True):
            with pytest.raises(InferenceServerException) as e:
                infer(client, "seq_acc_oldest_u64", 1, 0, start=start)
            assert e.value.message() == (
                "inference request to model 'seq_acc_oldest_u64' must specify a "
                "non-zero or non-empty correlation ID"
            )
    with pytest.raises(
        InferenceServerException, match="batch-size 1 due to requirements of sequence batcher"
    ):
        data = np.ones((2, 1), np.int32)
        inp = httpclient.InferInput("INPUT", [2, 1], "INT32")
        inp.set_data_from_numpy(data)
        http_client.infer("seq_acc_direct_u64", [inp], sequence_id=9, sequence_start=True)


def test_model_error_fails_only_that_request(server, grpc_client):
    sid = "err-seq"
    assert infer(grpc_client, "seq_acc_direct_str", 3, sid, start=True)[0] == 3
    with pytest.raises(InferenceServerException, match="negative input -1"):
        infer(grpc_client, "seq_acc_direct_str", -1, sid)
    assert infer(grpc_client, "seq_acc_direct_str", 4, sid)[0] == 7
    with pytest.raises(InferenceServerException, match="negative input -2"):
        infer(grpc_client, "seq_acc_direct_str", -2, sid, end=True)
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        infer(grpc_client, "seq_acc_direct_str", 1, sid)  # END closed it even though the request failed


def test_start_on_active_sequence_restarts_it(server, http_client, grpc_client):
    sid = 8080
    assert infer(http_client, "seq_acc_oldest_u64", 5, sid, start=True)[0] == 5
    assert infer(http_client, "seq_acc_oldest_u64", 5, sid)[0] == 10
    assert infer(grpc_client, "seq_acc_oldest_u64", 2, sid, start=True)[0] == 2
    assert infer(grpc_client, "seq_acc_oldest_u64", 2, sid, end=True)[0] == 4


def test_idle_sequence_is_released(server, grpc_client):
    model = "seq_acc_idle"  # one slot, 300 ms idle timeout
    assert infer(grpc_client, model, 1, 1, start=True, batched=False)[0] == 1
    for i in range(2, 7):  # requests closer together than the timeout keep it alive
        time.sleep(0.1)
        assert infer(grpc_client, model, 1, 1, batched=False)[0] == i
    # a new sequence waits in the backlog until the idle one is released and its slot frees
    t0 = time.monotonic()
    assert infer(grpc_client, model, 7, 2, start=True, batched=False)[0] == 7
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(InferenceServerException) as e:
        infer(grpc_client, model, 1, 1, batched=False)
    assert e.value.message() == (
        "inference request for sequence 1 to model 'seq_acc_idle' must specify the "
        "START flag on the first request of the sequence"
    )
    time.sleep(0.8)  # idle again: sequence 2 is released as well
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        infer(grpc_client, model, 1, 2, batched=False)
    assert infer(grpc_client, model, 5, 3, start=True, end=True, batched=False)[0] == 5


def test_start_waits_in_backlog_until_a_slot_frees(server, grpc_client):
    model = "seq_acc_backlog"  # one slot, 5 s idle timeout
    assert infer(grpc_client, model, 1, 11, start=True, batched=False)[0] == 1
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(run_sequence, server, model, 12, [3, 4], 1, False)
        time.sleep(0.5)
        assert not waiting.done()
        assert infer(grpc_client, model, 1, 11, end=True, batched=False)[0] == 2
        assert waiting.result(timeout=10) == [3, 7]


@pytest.mark.parametrize("model", ["seq_acc_stats_direct", "seq_acc_stats_oldest"])
def test_concurrent_sequences_are_batched(server, model):
    plans = [(100 + k, [k + 1] * 5) for k in range(4)]
    barrier = threading.Barrier(len(plans))

    def go(sid, values, n):
        barrier.wait()
        return run_sequence(server, model, sid, values, n)

    with ThreadPoolExecutor(len(plans)) as pool:
        futures = [pool.submit(go, sid, values, n) for n, (sid, values) in enumerate(plans)]
        for (_sid, values), fut in zip(plans, futures):
            assert fut.result(timeout=60) == list(np.cumsum(values))
    stats = stats_of(server, model)
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}
    assert max(sizes) > 1, sizes
    assert max(sizes) <= 4
    assert sum(size * n for size, n in sizes.items()) == 20
    assert stats["inference_count"] == 20
    assert stats["execution_count"] < 20
    assert stats["inference_stats"]["success"]["count"] == 20


def test_implicit_state_accumulates(server, http_client, grpc_client):
    a, b = 4242, "state-b"
    assert infer(http_client, "seq_state", 3, a, start=True, batched=False) == (3, ["OUTPUT"])
    assert infer(grpc_client, "seq_state", 10, b, start=True, batched=False) == (10, ["OUTPUT"])
    assert infer(grpc_client, "seq_state", 4, a, batched=False) == (7, ["OUTPUT"])
    assert infer(http_client, "seq_state", 10, b, batched=False, outputs=["OUTPUT"]) == (20, ["OUTPUT"])
    assert infer(http_client, "seq_state", 5, a, batched=False)[0] == 12
    # START again: the state starts over from the initial state
    assert infer(http_client, "seq_state", 1, a, start=True, batched=False)[0] == 1
    assert infer(grpc_client, "seq_state", 1, a, end=True, batched=False)[0] == 2
    assert infer(grpc_client, "seq_state", 1, b, end=True, batched=False)[0] == 21


def test_implicit_state_concurrent_and_from_file(server):
    plans = [(900 + k, [k + 1, 2, 3, 4]) for k in range(4)]
    with ThreadPoolExecutor(len(plans)) as pool:
        futures = [
            pool.submit(run_sequence, server, "seq_state_file", sid, values, n)
            for n, (sid, values) in enumerate(plans)
        ]
        for (_sid, values), fut in zip(plans, futures):
            assert fut.result(timeout=60) == list(100 + np.cumsum(values))


def test_invalid_control_fails_to_load(server):
    index = requests.post(f"{server.url}/v2/repository/index", timeout=10).json()
    entry = next(m for m in index if m["name"] == "seq_bad_control")
    assert entry.get("state") == "UNAVAILABLE"
    assert (
        "sequence batching control 'int32_false_true' must have exactly 2 entries for "
        "CONTROL_SEQUENCE_START for seq_bad_control"
    ) in entry.get("reason", "")


ONNX_STATE_CONFIG = """
name: "acc_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 4
sequence_batching {
  oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 100000 }
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_FP32 dims: [ 1 ]
            initial_state: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "zeros" } } ]
}
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def test_implicit_state_on_onnx_model(tmp_path):
    """A tensor backend: the server asks for the undeclared state output and batches states as [B, 1].

    Auto-complete is off: Naiad's ONNX auto-complete would declare INPUT_STATE as a client input."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    import warnings

    class Acc(torch.nn.Module):
        def forward(self, x, state):
            total = x + state
            return total, total * 1

    (tmp_path / "acc_onnx" / "1").mkdir(parents=True)
    names = ["INPUT", "INPUT_STATE", "OUTPUT", "OUTPUT_STATE"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Acc(),
            (torch.zeros(1, 1), torch.zeros(1, 1)),
            str(tmp_path / "acc_onnx" / "1" / "model.onnx"),
            input_names=names[:2],
            output_names=names[2:],
            dynamic_axes={n: {0: "batch"} for n in names},
            opset_version=17,
            dynamo=False,
        )
    (tmp_path / "acc_onnx" / "config.pbtxt").write_text(ONNX_STATE_CONFIG)

    def run(server, sid, values):
        client = grpcclient.InferenceServerClient(server.grpc)
        got = []
        for i, v in enumerate(values):
            inp = grpcclient.InferInput("INPUT", [1, 1], "FP32")
            inp.set_data_from_numpy(np.array([[v]], np.float32))
            asked = [grpcclient.InferRequestedOutput("OUTPUT")] if i % 2 else None
            r = client.infer(
                "acc_onnx",
                [inp],
                outputs=asked,
                sequence_id=sid,
                sequence_start=i == 0,
                sequence_end=i == len(values) - 1,
            )
            got.append((float(r.as_numpy("OUTPUT")[0, 0]), [o.name for o in r.get_response().outputs]))
        client.close()
        return got

    with NaiadProcess(tmp_path, "--disable-auto-complete-config") as proc:
        with ThreadPoolExecutor(4) as pool:
            futures = {sid: pool.submit(run, proc, sid, [float(sid)] * 4) for sid in (1, 2, 3, 4)}
            for sid, fut in futures.items():
                assert fut.result(timeout=60) == [(sid * k, ["OUTPUT"]) for k in (1.0, 2.0, 3.0, 4.0)]
        stats = stats_of(proc, "acc_onnx")
    assert stats["inference_count"] == 16
    assert any(b["batch_size"] > 1 for b in stats["batch_stats"])


def test_cancelled_request_cancels_its_sequence(server, grpc_client):
    model = "seq_acc_stats_direct"  # executions take 50 ms
    sid = 31337
    assert infer(grpc_client, model, 1, sid, start=True)[0] == 1
    done = threading.Event()
    results = []
    data = np.array([[2]], dtype=np.int32)
    inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(data)

    def callback(result, error):
        results.append((result, error))
        done.set()

    grpc_client.async_infer(model, [inp], callback, sequence_id=sid)
    time.sleep(0.01)  # the first request executes; the next one queues behind it and gives up
    with pytest.raises(InferenceServerException, match="Deadline"):
        grpc_client.infer(model, [inp], sequence_id=sid, client_timeout=0.02)
    assert done.wait(10) and results[0][1] is None
    assert int(results[0][0].as_numpy("OUTPUT")[0, 0]) == 3
    time.sleep(0.2)
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        infer(grpc_client, model, 1, sid)
