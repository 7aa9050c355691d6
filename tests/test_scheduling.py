"""Dynamic batcher, queue policies, priorities, response cache and warmup, observed through tritonclient."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from helpers import NaiadProcess
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def sched(model_repo):
    with NaiadProcess(
        model_repo,
        "--model-control-mode",
        "explicit",
        "--cache-config",
        "local,size=1048576",
        *[
            a
            for m in (
                "batched",
                "preferred",
                "queue_limited",
                "queue_timeout",
                "prioritized",
                "cached",
                "mlp_onnx",
            )
            for a in ("--load-model", m)
        ],
    ) as proc:
        yield proc


def one(value: float, rows: int = 1):
    inp = httpclient.InferInput("INPUT0", [rows, 1], "FP32")
    inp.set_data_from_numpy(np.full((rows, 1), value, np.float32))
    return [inp]


def concurrently(fn, n: int):
    results, errors = [None] * n, [None] * n

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, errors


def test_dynamic_batcher_forms_batches(sched):
    client = httpclient.InferenceServerClient(sched.http, concurrency=8)
    pending = [client.async_infer("batched", one(i, rows=1 + i % 2)) for i in range(6)]
    results = [p.get_result() for p in pending]
    for i, r in enumerate(results):
        assert r.as_numpy("OUTPUT0").reshape(-1).tolist() == [float(i)] * (1 + i % 2)  # split back correctly
    assert max(int(r.as_numpy("BATCH")[0, 0]) for r in results) > 1
    stats = client.get_inference_statistics("batched")["model_stats"][0]
    assert stats["inference_count"] == sum(1 + i % 2 for i in range(6))
    assert stats["execution_count"] < 6
    assert any(b["batch_size"] > 1 for b in stats["batch_stats"])


def test_preferred_batch_size_sent_without_waiting_for_the_delay(sched):
    client = httpclient.InferenceServerClient(sched.http, concurrency=4)
    start = time.monotonic()
    pending = [client.async_infer("preferred", one(i)) for i in range(4)]
    results = [p.get_result() for p in pending]
    assert time.monotonic() - start < 2.0  # the queue delay is 3 s: the preferred size went at once
    assert {int(r.as_numpy("BATCH")[0, 0]) for r in results} == {4}


def test_max_queue_size_rejects_at_once(sched):
    def call(i):
        c = httpclient.InferenceServerClient(sched.http, network_timeout=30)
        return c.infer("queue_limited", one(i))

    results, errors = concurrently(call, 6)
    rejected = [e for e in errors if e is not None]
    assert rejected, "a full queue must reject"
    assert all("Exceeds maximum queue size" in str(e) for e in rejected)
    assert all(e.status() == "503" for e in rejected)
    assert sum(r is not None for r in results) >= 3  # one executing + two queued


def test_queue_timeout_rejects(sched):
    def call(i):
        c = httpclient.InferenceServerClient(sched.http, network_timeout=30)
        return c.infer("queue_timeout", one(i))

    results, errors = concurrently(call, 3)
    timed_out = [e for e in errors if e is not None]
    assert timed_out and all("timeout" in str(e).lower() for e in timed_out)
    assert results.count(None) == len(timed_out)


def test_request_timeout_override_shortens(sched):
    client = httpclient.InferenceServerClient(sched.http, concurrency=2)
    blocker = client.async_infer("queue_timeout", one(0))
    time.sleep(0.05)
    with pytest.raises(InferenceServerException, match="[Tt]imeout"):
        client.infer("queue_timeout", one(1), timeout=1000)  # 1 ms
    blocker.get_result()


def test_priorities_reorder_the_queue(sched):
    client = httpclient.InferenceServerClient(sched.http, concurrency=8)
    blocker = client.async_infer("prioritized", one(0))
    # the blocker is executing (1 s: config.pbtxt's sleep_s, room for a loaded machine); everything below queues
    # behind it, the high-priority request too (with 0.3 s, one loaded make test run saw a low one run before it:
    # the high one had not reached the queue when the blocker ended)
    time.sleep(0.2)
    low = [client.async_infer("prioritized", one(1), priority=2) for _ in range(3)]
    time.sleep(0.05)
    high = client.async_infer("prioritized", one(2), priority=1)
    blocker.get_result()
    order_high = int(high.get_result().as_numpy("ORDER")[0, 0])
    order_low = [int(p.get_result().as_numpy("ORDER")[0, 0]) for p in low]
    assert order_high < min(order_low)
    with pytest.raises(InferenceServerException, match="priority"):
        client.infer("prioritized", one(3), priority=9)


def test_response_cache_hits(sched):
    client = httpclient.InferenceServerClient(sched.http)
    first = client.infer("cached", one(42.0)).as_numpy("ORDER")
    again = client.infer("cached", one(42.0)).as_numpy("ORDER")
    other = client.infer("cached", one(43.0)).as_numpy("ORDER")
    assert again.tolist() == first.tolist()  # served from the cache: the model did not run again
    assert other.tolist() != first.tolist()
    stats = client.get_inference_statistics("cached")["model_stats"][0]
    assert stats["inference_stats"]["cache_hit"]["count"] == 1
    assert stats["inference_stats"]["cache_miss"]["count"] == 2
    assert stats["execution_count"] == 2 and stats["inference_stats"]["success"]["count"] == 3
    import requests

    text = requests.get(f"http://{sched.metrics}/metrics").text
    assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 1.0' in text


def test_onnx_dynamic_batching_matches_unbatched(sched, model_repo):
    import onnxruntime as ort

    client = httpclient.InferenceServerClient(sched.http, concurrency=8)
    xs = [np.random.default_rng(i).random((1, 16), dtype=np.float32) for i in range(16)]

    def req(x):
        inp = httpclient.InferInput("input", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        return client.async_infer("mlp_onnx", [inp])

    outs = [p.get_result().as_numpy("output") for p in [req(x) for x in xs]]
    sess = ort.InferenceSession(str(model_repo / "mlp_onnx" / "1" / "model.onnx"))
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out, sess.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6)


def test_warmup_runs_on_every_instance_before_ready(model_repo):
    with NaiadProcess(model_repo, "--model-control-mode", "explicit", "--load-model", "add_sub") as proc:
        client = httpclient.InferenceServerClient(proc.http, concurrency=2)
        start = time.monotonic()
        import requests  # tritonclient.http (gevent) must stay on its own thread

        loading = threading.Thread(target=requests.post, args=(f"{proc.url}/v2/repository/models/warm/load",))
        loading.start()
        time.sleep(0.3)
        assert not client.is_model_ready("warm")  # still warming up
        loading.join(30)
        assert time.monotonic() - start >= 1.9  # 2 instances x count 2 x 0.5 s each
        assert client.is_model_ready("warm")
        results = [client.async_infer("warm", one(1)) for _ in range(2)]
        for r in results:
            assert int(r.get_result().as_numpy("WARMED")[0, 0]) == 2  # each instance ran count=2 samples


def test_ensemble_warmup_beyond_triton(model_repo):
    with NaiadProcess(model_repo, "--model-control-mode", "explicit") as proc:
        client = httpclient.InferenceServerClient(proc.http)
        client.load_model("ensemble_warm")  # loads scale_python first, then warms the ensemble up
        assert client.is_model_ready("scale_python") and client.is_model_ready("ensemble_warm")
        stats = client.get_inference_statistics("scale_python")["model_stats"][0]
        assert stats["inference_count"] == 1  # the warmup sample went through the step


def test_rate_limiter_serialises_executions_across_models(model_repo):
    """Two models x two instances, each execution needs resource R; with R:1 only one runs at a time."""
    import requests

    def run_four(proc) -> float:
        def call(i):
            body = {"inputs": [{"name": "SECONDS", "shape": [1], "datatype": "FP32", "data": [0.3]}]}
            r = requests.post(f"{proc.url}/v2/models/limited_{'ab'[i % 2]}/infer", json=body, timeout=30)
            assert r.status_code == 200, r.text

        start = time.monotonic()
        _results, errors = concurrently(call, 4)
        assert errors == [None] * 4
        return time.monotonic() - start

    common = ("--model-control-mode", "explicit", "--load-model", "limited_a", "--load-model", "limited_b")
    with NaiadProcess(
        model_repo, *common, "--rate-limit", "execution_count", "--rate-limit-resource", "R:1"
    ) as p:
        limited = run_four(p)
    with NaiadProcess(model_repo, *common) as p:
        free = run_four(p)
    assert limited >= 1.15  # 4 x 0.3 s, one at a time
    assert free < 0.9  # 4 instances in parallel
