"""A small ONNX graph executes on the event loop once it has proved fast (base.InlinePolicy), as python models do:
a thread hop per execution cost a 16-value ONNX identity request 330 µs of server CPU against 94 µs inline
(bench/frontend_workers.py --backend onnxruntime); the answers are the same either way."""

from __future__ import annotations

import json

import numpy as np

from naiad.frontends.http import HttpFrontend
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
    policy.observe(InlinePolicy.EVICT_NS + 1)  # one execution past the eviction limit is enough
    assert not policy.inline
