"""stats.ModelStats.record_run: an execution's counts land at the end of the loop's turn (after the responses are
written), and every reader (the statistics extension, the Prometheus exposition) sees them before that."""

from __future__ import annotations

import asyncio

from naiad.metrics import Metrics, parse_metrics_config
from naiad.stats import ModelStats


def _success(stats: dict) -> int:
    return stats["inference_stats"]["success"]["count"]


async def test_a_deferred_execution_is_counted_at_the_end_of_the_turn():
    stats = ModelStats("m", "1")
    stats.record_run(2, 10, 20, 30, [(True, 1000, 100), (False, 2000, 200)])
    assert stats.success.count == 0  # not on the way to the responses
    await asyncio.sleep(0)
    assert stats.success.count == 1 and stats.fail.count == 1
    assert stats.execution_count == 1 and stats.inference_count == 2
    assert stats.queue.ns == 100 and stats.compute_infer.ns == 20
    assert stats.failures_by_reason == {"BACKEND": 1}


async def test_a_deferred_request_reaches_the_latency_observers_as_a_direct_one_does():
    """flush counts a turn's executions under one hold of the lock, then tells the observers (the Prometheus
    histograms) of each request exactly as record_request does: queue and compute only for a success."""
    seen: list[tuple] = []
    direct, deferred = ModelStats("m", "1"), ModelStats("m", "1")
    for stats in (direct, deferred):
        stats.observers.append(lambda *args, into=seen: into.append(args))
    direct.record_execution(2, 10, 20, 30)
    direct.record_request(True, 1000, 100, 10, 20, 30, reason="BACKEND")
    direct.record_request(False, 2000, 200, 10, 20, 30, reason="BACKEND")
    expected, seen[:] = list(seen), []
    deferred.record_run(2, 10, 20, 30, [(True, 1000, 100), (False, 2000, 200)])
    assert seen == [] and deferred.last_inference_ms == 0
    await asyncio.sleep(0)
    assert seen == expected == [("m", "1", 1e-6, 1e-7, 6e-8), ("m", "1", 2e-6, None, None)]
    assert deferred.last_inference_ms > 0
    a, b = direct.as_dict(), deferred.as_dict()
    a.pop("last_inference"), b.pop("last_inference")
    assert a == b


async def test_the_statistics_extension_sees_a_run_recorded_in_the_same_turn():
    stats = ModelStats("m", "1")
    for _ in range(3):
        stats.record_run(1, 1, 2, 3, [(True, 500, 50)])
    doc = stats.as_dict()  # no turn of the loop in between
    assert _success(doc) == 3 and doc["execution_count"] == 3
    assert doc["batch_stats"][0]["compute_infer"] == {"count": 3, "ns": 6}
    await asyncio.sleep(0)  # the queued flush finds nothing left to count
    assert _success(stats.as_dict()) == 3


async def test_the_prometheus_exposition_and_the_statistics_api_count_a_request_at_once(model_repo):
    """A real server in this process: right after an infer returns (no turn of the loop since), both readers
    count it, histograms included."""
    import numpy as np

    from naiad.frontends.http.frontend import HttpFrontend
    from naiad.server import Server, ServerOptions

    server = Server(ServerOptions(model_repositories=[str(model_repo)], strict_readiness=False))
    metrics = Metrics(server, parse_metrics_config([]), cpu=False, gpu=False)
    await server.start()
    try:
        frontend = HttpFrontend(server)
        body = b'{"inputs":[{"name":"INPUT0","shape":[1,2],"datatype":"FP32","data":[1,2]}]}'
        for n in range(1, 41):  # past the inline policy's warm-up: later ones execute on the loop
            await frontend.run_infer("identity_fp32", "", body, None)
            text = metrics.exposition().decode()
            assert f'nv_inference_request_success{{model="identity_fp32",version="1"}} {n}.0' in text
            assert (
                f'nv_inference_request_duration_seconds_count{{model="identity_fp32",version="1"}} {n}.0'
                in text
            )
            (doc,) = server.model_statistics("identity_fp32")
            assert _success(doc) == n
        assert np.isfinite(
            float(text.split('nv_inference_queue_duration_seconds_sum{model="identity_fp32"')[1].split()[1])
        )
    finally:
        metrics.close()
        await server.stop(1)
