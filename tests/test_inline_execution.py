"""A small ONNX graph executes on the event loop once it has proved fast (base.InlinePolicy), as python models do:
a thread hop per execution cost a 16-value ONNX identity request 330 µs of server CPU against 94 µs inline
(bench/frontend_workers.py --backend onnxruntime); the answers are the same either way."""

from __future__ import annotations

import json

import numpy as np

from naiad.frontends.http.frontend import HttpFrontend
from naiad.server import Server, ServerOptions


async def test_a_fast_onnx_instance_moves_onto_the_loop_and_answers_the_same(model_repo):
    server = Server(ServerOptions(model_repositories=[str(model_repo)], strict_readiness=False))
    await server.start()
    try:
        frontend = HttpFrontend(server)
        (instance,) = server.repository.get("mlp_onnx").pool.instances
        x = np.random.default_rng(3).random((2, 16), dtype=np.float32)
        body = json.dumps(
            {"inputs": [{"name": "input", "shape": [2, 16], "datatype": "FP32", "data": x.ravel().tolist()}]}
        ).encode()
        answers = []
        for _ in range(instance.inline.QUALIFY + 8):
            chunks, _headers = await frontend.run_infer("mlp_onnx", "", body, None)
            answers.append(json.loads(b"".join(bytes(c) for c in chunks))["outputs"][0]["data"])
        assert instance.inline.inline, "a graph this small should execute on the event loop"
        assert all(a == answers[0] for a in answers)
    finally:
        await server.stop(1)


def test_the_policy_sends_an_instance_back_to_its_thread_when_its_executions_grow():
    """Qualified on small batches, then a dynamic batcher composes large ones: under the one-execution eviction
    limit each, but on average past twice the qualifying limit, so the instance goes back to its thread."""
    from naiad.backends.base import InlinePolicy

    policy = InlinePolicy(True)
    for _ in range(InlinePolicy.QUALIFY):
        policy.observe(20_000)
    assert policy.inline
    grown = 0
    while policy.inline:
        policy.observe(InlinePolicy.EVICT_NS // 2)
        grown += 1
    assert grown < 10
    for _ in range(InlinePolicy.QUALIFY * 2):  # as long as they stay large it stays on its thread
        policy.observe(InlinePolicy.EVICT_NS // 2)
    assert not policy.inline
    for _ in range(InlinePolicy.QUALIFY):  # small again: it qualifies again
        policy.observe(20_000)
    assert policy.inline
    policy.observe(InlinePolicy.EVICT_NS + 1)  # two executions in a row past the eviction limit are enough
    assert policy.inline
    policy.observe(InlinePolicy.EVICT_NS + 1)
    assert not policy.inline


def test_a_lone_slow_execution_is_the_cpu_not_the_model():
    """Wall time counts the time the thread did not run: a preemption (a few ms) or a CPU limit's throttling (the
    rest of a CFS period, tens of ms) makes one execution of a 20 µs model look slow. Alone, or a few in a row
    under the eviction limit, they neither send it to its thread nor count fully in its average."""
    from naiad.backends.base import InlinePolicy

    policy = InlinePolicy(True)
    for _ in range(InlinePolicy.QUALIFY):
        policy.observe(20_000)
    assert policy.inline
    for _ in range(50):  # throttled once a period, fast in between
        policy.observe(40_000_000)
        for _ in range(5):
            policy.observe(20_000)
        assert policy.inline
    for _ in range(2):  # preempted two executions in a row, each for 1.9 ms
        policy.observe(1_900_000)
    assert policy.inline
    slow = 0
    while policy.inline:  # a model that turned slow goes, whatever came before
        policy.observe(1_900_000)
        slow += 1
    assert slow <= 2
    # fast again; one throttled execution on its thread does not hold it back
    for i in range(InlinePolicy.QUALIFY):
        policy.observe(40_000_000 if i == 10 else 20_000)
    assert policy.inline


async def test_a_queue_in_front_of_an_inline_instance_empties_in_one_turn(model_repo):
    """Requests that queued while the instance was busy (on its thread before it qualified, say) are executed
    back to back by the dispatcher once it is free, not one a turn: a closed-loop load that refills the queue as
    fast as it empties would otherwise keep every later request on the queued path for as long as it lasts."""
    import asyncio

    from naiad.inference import InferenceRequest

    server = Server(ServerOptions(model_repositories=[str(model_repo)], strict_readiness=False))
    await server.start()
    try:
        mv = server.repository.get("mlp_onnx")
        x = np.random.default_rng(4).random((2, 16), dtype=np.float32)

        def request() -> InferenceRequest:
            return InferenceRequest(model_name="mlp_onnx", inputs={"input": x}, datatypes={"input": "FP32"})

        (instance,) = mv.pool.instances
        for _ in range(instance.inline.QUALIFY + 8):
            await server.infer(request())
        assert instance.inline.inline
        held = mv.pool.try_acquire()  # busy: the first requests of each client queue
        queued_at_submit = []

        async def client() -> None:
            for _ in range(20):  # each sends its next request as soon as it has its answer
                queued_at_submit.append(mv.scheduler.queued > 0)
                await server.infer(request())

        clients = [asyncio.ensure_future(client()) for _ in range(32)]
        for _ in range(3):
            await asyncio.sleep(0)
        assert mv.scheduler.queued == 32
        mv.pool.release(held)
        await asyncio.gather(*clients)
        later = queued_at_submit[32:]
        assert sum(later) <= len(later) // 10, f"{sum(later)} of {len(later)} later requests met a queue"
    finally:
        await server.stop(1)
