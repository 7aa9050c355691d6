"""engine/client.EngineClient against a real engine connection: a request its caller gives up on is cancelled in the
engine too, a response nobody reads (its call given up, its stream closed) gives its shared-memory slab back, and
a slab the engine unlinks is unmapped by the worker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np
import pytest

from naiad.engine.client import EngineClient
from naiad.engine.core import EngineService
from naiad.engine.slabs import SHM_DIR
from naiad.inference import InferenceRequest, InferenceResponse, OutputTensor
from naiad.shared_memory.system import SharedMemoryManager

BIG = 65536  # FP32 values: 256 KiB, past the inline limit, so the output travels in one of the engine's slabs


class _Tracer:
    active = False


class _Server:
    """A model that waits until cancelled; with `answer_anyway` it answers even then (a reply that crosses the
    worker's Cancel on the socket), with an output large enough for a slab."""

    tracer = _Tracer()

    def __init__(self, answer_anyway: bool = False):
        self.answer_anyway = answer_anyway
        self.started = 0
        self.cancelled = 0
        self.answered = 0
        self.streamed = 0

    def metadata(self) -> dict:
        return {"name": "naiad", "version": "test", "extensions": []}

    async def infer(self, req):
        if req.model_name == "at_once":
            return InferenceResponse(
                req.model_name, "1", [OutputTensor("OUT", "FP32", np.ones(BIG, np.float32))]
            )
        self.started += 1
        try:
            await asyncio.get_running_loop().create_future()  # never done
        except asyncio.CancelledError:
            self.cancelled += 1
            if not self.answer_anyway:
                raise
        self.answered += 1
        return InferenceResponse(req.model_name, "1", [OutputTensor("OUT", "FP32", np.ones(BIG, np.float32))])

    async def infer_stream(self, req):
        """Three responses at once, each in a slab of its own."""
        for i in range(3):
            self.streamed += 1
            yield InferenceResponse(
                req.model_name, "1", [OutputTensor("OUT", "FP32", np.full(BIG, i, np.float32))], final=i == 2
            )


@contextlib.contextmanager
def _engine(server: _Server) -> Iterator[EngineService]:
    """An engine serving `server` on its own event loop thread (the worker's control calls block)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = EngineService(server, SharedMemoryManager(enabled=True))  # type: ignore[arg-type]
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result(10)
    try:
        yield engine
    finally:
        asyncio.run_coroutine_threadsafe(engine.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.asynccontextmanager
async def _connected(server: _Server) -> AsyncIterator[tuple[EngineService, EngineClient]]:
    """An engine serving `server`, and a worker's client connected to it."""
    with _engine(server) as engine:
        client = EngineClient(engine.path)
        await client.connect()
        try:
            yield engine, client
        finally:
            client.close()


async def _until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _give_up_on_one(client: EngineClient, server: _Server) -> None:
    """Start a request, wait until the engine runs it, then cancel it as a passed gRPC deadline does."""
    started = server.started
    task = asyncio.ensure_future(
        client.infer(InferenceRequest("m", {"X": np.ones(4, np.float32)}, {"X": "FP32"}))
    )
    await _until(lambda: server.started > started, "the engine to run the request")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_request_its_caller_gives_up_on_is_cancelled_in_the_engine():
    server = _Server()
    async with _connected(server) as (_, client):
        await _give_up_on_one(client, server)
        await _until(lambda: server.cancelled == 1, "the engine to cancel the request")
        assert server.answered == 0


async def test_a_reply_nobody_waits_for_gives_its_slab_back():
    server = _Server(answer_anyway=True)
    async with _connected(server) as (engine, client):
        for n in range(1, 4):
            await _give_up_on_one(client, server)
            await _until(lambda: server.answered == n, "the engine to answer")  # noqa: B023
            await _until(lambda: not engine.pool._refs, "the worker to free the reply's slab")
        segments = [f for f in os.listdir(SHM_DIR) if f.startswith(engine.pool.prefix + "-")]
        assert len(segments) == 1, segments  # three replies, one slab reused (not one leaked per reply)


async def test_responses_a_stream_left_unread_give_their_slabs_back():
    server = _Server()
    async with _connected(server) as (engine, client):
        stream = client.infer_stream(InferenceRequest("m", {"X": np.ones(4, np.float32)}, {"X": "FP32"}))
        first = await stream.__anext__()
        assert first.outputs[0].data[0] == 0
        await _until(lambda: server.streamed == 3, "the engine to send every response")
        await asyncio.sleep(0.1)  # (for them to reach the worker's queue)
        await stream.aclose()  # the caller stops reading: the two responses queued are never decoded
        del first
        await _until(lambda: not engine.pool._refs, "the worker to free the unread responses' slabs")


def _mapped(prefix: str) -> set[str]:
    """The inodes of this process's mappings of segments named `<prefix>-...` (the engine runs in a thread of it
    here; earlier tests' engines used the same names, so a test compares inodes)."""
    with open("/proc/self/maps") as f:
        return {line.split()[4] for line in f if f"/{prefix}-" in line}


async def test_an_output_slab_the_engine_lets_go_is_unmapped_by_its_worker():
    server = _Server()
    async with _connected(server) as (engine, client):
        # an output's slab is more than half of the limit: unlinked once the worker is done with it
        engine.pool.limit = 256 * 1024
        before = _mapped(engine.pool.prefix)
        resp = await client.infer(InferenceRequest("at_once", {"X": np.ones(4, np.float32)}, {"X": "FP32"}))
        assert resp.outputs[0].data.sum() == BIG
        assert _mapped(engine.pool.prefix) - before  # the worker reads the output where the engine wrote it
        del resp
        await _until(
            lambda: not _mapped(engine.pool.prefix) - before, "the worker to unmap the engine's slab"
        )
        assert not [f for f in os.listdir(SHM_DIR) if f.startswith(engine.pool.prefix + "-")]
