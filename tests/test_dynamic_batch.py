"""Batch assembly in the dynamic batch scheduler, through its public interface (`create_scheduler`, `submit`).

The model is a backend written for these tests against the public backend API (`ModelInstance`): it records the
requests of each execution and can hold its first execution, so that later requests queue up and the scheduler
has a queue to assemble batches from.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from naiad.backends.base import ModelContext, ModelInstance
from naiad.config import parse_text
from naiad.inference import InferenceRequest, InferenceResponse, OutputTensor
from naiad.scheduling.dynamic_batch import DynamicBatchScheduler
from naiad.scheduling.pool import InstancePool
from naiad.scheduling.scheduler import create_scheduler
from naiad.stats import ModelStats


class RecordingInstance(ModelInstance):
    """Echoes INPUT0; records each execution as the list of its requests' ids; holds the first execution
    until `release` is set."""

    def __init__(self, ctx: ModelContext, group):
        super().__init__(ctx, group, 0, 0)
        self.executions: list[list[str]] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def execute(self, requests, timing):
        self.executions.append([r.id for r in requests])
        if len(self.executions) == 1:
            self.started.set()
            assert self.release.wait(30), "the test never released the first execution"
        return [
            InferenceResponse(
                model_name=r.model_name,
                model_version="1",
                outputs=[OutputTensor("OUTPUT0", "FP32", r.inputs["INPUT0"])],
                id=r.id,
            )
            for r in requests
        ]


def make_scheduler(config_text: str):
    config = parse_text(config_text)
    ctx = ModelContext(
        name=config.name,
        version=1,
        config=config,
        model_dir=Path("/nonexistent"),
        version_dir=Path("/nonexistent/1"),
    )
    group = mc.ModelInstanceGroup(name=config.name, count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    inst = RecordingInstance(ctx, group)
    stats = ModelStats(config.name, "1")
    pool = InstancePool([inst], stats, config.max_batch_size > 0)
    return create_scheduler(ctx, pool, stats, None), inst, pool


def request(rid: str, rows: int = 1, width: int = 4, priority: int = 0) -> InferenceRequest:
    return InferenceRequest(
        model_name="m",
        inputs={"INPUT0": np.full((rows, width), float(len(rid)), dtype=np.float32)},
        datatypes={"INPUT0": "FP32"},
        id=rid,
        priority=priority,
    )


async def run_queued(config_text: str, queued: list[InferenceRequest]) -> list[list[str]]:
    """Hold the instance with a first request, queue `queued` behind it, let go, and return the executions
    after the first."""
    scheduler, inst, pool = make_scheduler(config_text)
    try:
        first = asyncio.ensure_future(scheduler.submit(request("first")))
        assert await asyncio.to_thread(inst.started.wait, 30)
        tasks = [asyncio.ensure_future(scheduler.submit(r)) for r in queued]
        await asyncio.sleep(0.05)  # every request is in the queue
        inst.release.set()
        responses = await asyncio.gather(first, *tasks)
        for r, resp in zip(queued, responses[1:]):
            assert resp.id == r.id
            np.testing.assert_array_equal(resp.output("OUTPUT0").data, r.inputs["INPUT0"])
        assert inst.executions[0] == ["first"]
        return inst.executions[1:]
    finally:
        inst.release.set()
        await scheduler.close(5)
        pool.close()


BATCHED = """
name: "m"
max_batch_size: 8
input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }]
output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }]
"""


async def test_the_factory_gives_a_dynamic_batch_scheduler():
    scheduler, _inst, pool = make_scheduler(BATCHED + "dynamic_batching { }")
    assert isinstance(scheduler, DynamicBatchScheduler) and scheduler.stats is pool.stats
    await scheduler.close(1)
    pool.close()


async def test_queued_requests_form_batches_up_to_max_batch_size():
    ids = [f"r{i}" for i in range(11)]
    batches = await run_queued(BATCHED + "dynamic_batching { }", [request(i) for i in ids])
    assert batches == [ids[:8], ids[8:]]


async def test_a_request_that_would_pass_max_batch_size_waits_for_the_next_batch():
    # rows 3 + 3 = 6; a third 3-row request would make 9 > 8
    batches = await run_queued(BATCHED + "dynamic_batching { }", [request(f"r{i}", rows=3) for i in range(3)])
    assert batches == [["r0", "r1"], ["r2"]]


async def test_batches_are_trimmed_to_the_largest_preferred_size():
    config = BATCHED + "dynamic_batching { preferred_batch_size: [ 2, 4 ] }"
    batches = await run_queued(config, [request(f"r{i}") for i in range(7)])
    assert batches == [["r0", "r1", "r2", "r3"], ["r4", "r5"], ["r6"]]


async def test_requests_of_other_shapes_are_left_for_a_later_batch_in_order():
    queued = [request("a", width=4), request("b", width=5), request("c", width=4), request("d", width=5)]
    batches = await run_queued(BATCHED + "dynamic_batching { }", queued)
    assert batches == [["a", "c"], ["b", "d"]]


async def test_ragged_inputs_batch_whatever_their_shapes():
    config = BATCHED.replace("dims: [ -1 ] }]\noutput", "dims: [ -1 ] allow_ragged_batch: true }]\noutput")
    assert "allow_ragged_batch" in config
    queued = [request("a", width=4), request("b", width=5), request("c", width=4)]
    batches = await run_queued(config + "dynamic_batching { }", queued)
    assert batches == [["a", "b", "c"]]


async def test_higher_priority_requests_go_first():
    config = BATCHED.replace("max_batch_size: 8", "max_batch_size: 2") + (
        "dynamic_batching { priority_levels: 2 default_priority_level: 2 }"
    )
    queued = [request("low0"), request("low1", priority=2), request("high", priority=1)]
    batches = await run_queued(config, queued)
    assert batches == [["high", "low0"], ["low1"]]


async def test_without_dynamic_batching_each_request_runs_alone():
    batches = await run_queued(BATCHED, [request(f"r{i}") for i in range(3)])
    assert batches == [["r0"], ["r1"], ["r2"]]


@pytest.mark.parametrize("priority", [-1, 3])
async def test_a_priority_outside_the_levels_is_refused(priority):
    from naiad.errors import InvalidArgument

    scheduler, _inst, pool = make_scheduler(BATCHED + "dynamic_batching { priority_levels: 2 }")
    try:
        with pytest.raises(InvalidArgument, match="out of range"):
            await scheduler.submit(request("r", priority=priority))
    finally:
        await scheduler.close(1)
        pool.close()


@pytest.mark.parametrize("config", [BATCHED + "dynamic_batching { }", BATCHED], ids=["dynamic", "default"])
async def test_an_answered_queued_request_is_not_kept_by_the_dispatcher(config):
    """Once a queued request is answered and its caller lets go, nothing in the scheduler keeps its tensors:
    the dispatcher's last batch used to stay alive in its locals until the next queued request (a 256 MiB
    message's receive buffer, through the identity output that is a view of the input)."""
    scheduler, inst, pool = make_scheduler(config)
    try:
        first = asyncio.ensure_future(scheduler.submit(request("first")))
        assert await asyncio.to_thread(inst.started.wait, 30)
        queued = request("queued")
        tensor = weakref.ref(queued.inputs["INPUT0"])
        task = asyncio.ensure_future(scheduler.submit(queued))
        await asyncio.sleep(0.05)  # in the queue behind the held execution
        inst.release.set()
        await first
        response = await task
        same = response.output("OUTPUT0").data is tensor()
        assert same  # (the identity output is the input itself)
        del queued, task, response
        await asyncio.sleep(0.05)  # the dispatcher is waiting for its next request again
        gc.collect()
        assert tensor() is None, [type(r).__name__ for r in gc.get_referrers(tensor())]
    finally:
        inst.release.set()
        await scheduler.close(5)
        pool.close()
