"""engine/core.WorkerConnection: a forwarded request runs at once when its model answers without waiting, and
under a Task (cancelled with the connection) when it has to wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import numpy as np

from naiad.engine import wire
from naiad.engine.core import EngineService, WorkerConnection
from naiad.inference import InferenceResponse, OutputTensor
from naiad.shared_memory.system import SharedMemoryManager


class _Tracer:
    active = False


class _Server:
    """What the engine asks of a Server to run a request: a model that answers at once or when told."""

    tracer = _Tracer()

    def __init__(self):
        self.gate: asyncio.Future | None = None
        self.cancelled = 0

    async def infer(self, req):
        if req.model_name == "waits":
            self.gate = asyncio.get_running_loop().create_future()
            try:
                await self.gate
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        x = req.inputs["INPUT0"]
        return InferenceResponse(req.model_name, "1", [OutputTensor("OUTPUT0", "FP32", x * 2)])


def _infer(rid: int, model: str) -> wire.Infer:
    data = np.arange(4, dtype=np.float32).tobytes()
    t = wire.Tensor("INPUT0", "FP32", "<f4", [4], data)
    return wire.Infer(rid, wire.Request(model, -1, "", [t], [], {}, 0, 0, 0, 0, None))


@contextlib.contextmanager
def _connection(server: _Server) -> Iterator[WorkerConnection]:
    """A worker's connection to an engine over `server`; what it sends is collected in `conn.sent`."""
    engine = EngineService(server, SharedMemoryManager(enabled=True))  # type: ignore[arg-type]
    conn = WorkerConnection(engine)
    conn.sent = []  # type: ignore[attr-defined]
    conn.channel.send = conn.sent.append  # type: ignore[attr-defined,method-assign]
    try:
        yield conn
    finally:
        engine.pool.close()


class _Transport:
    def __init__(self):
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        pass


def _outputs(reply: wire.Reply) -> list[float]:
    return np.frombuffer(reply.response.outputs[0].data, np.float32).tolist()


async def test_a_request_that_never_waits_is_answered_inside_the_read_without_a_task():
    with _connection(_Server()) as conn:
        before = len(asyncio.all_tasks())
        conn.on_message(_infer(1, "at_once"))
        assert [type(m) for m in conn.sent] == [wire.Reply] and conn.sent[0].id == 1
        assert _outputs(conn.sent[0]) == [0.0, 2.0, 4.0, 6.0]
        assert not conn.tasks and len(asyncio.all_tasks()) == before


async def test_a_request_that_waits_is_driven_by_a_task_and_answered_when_its_model_is():
    server = _Server()
    with _connection(server) as conn:
        conn.on_message(_infer(2, "waits"))
        assert not conn.sent and set(conn.tasks) == {2}
        conn.on_message(_infer(3, "at_once"))  # others are not held up behind it
        assert [m.id for m in conn.sent] == [3]
        assert server.gate is not None
        server.gate.set_result(None)
        await asyncio.wait_for(conn.tasks[2], 5)
        assert [m.id for m in conn.sent] == [3, 2] and _outputs(conn.sent[1]) == [0.0, 2.0, 4.0, 6.0]
        assert not conn.tasks


async def test_a_waiting_request_is_cancelled_when_its_worker_goes_away():
    server = _Server()
    with _connection(server) as conn:
        conn.on_message(_infer(4, "waits"))
        task = conn.tasks[4]
        conn.on_lost()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled() and server.cancelled == 1 and not conn.sent


async def test_the_replies_a_read_made_are_written_before_the_loop_turns():
    with _connection(_Server()) as conn:
        del conn.channel.send  # the channel's own: queued, then written
        transport = _Transport()
        conn.channel.connection_made(transport)
        conn.channel.data_received(b"".join(wire.frame(_infer(i, "at_once")) for i in (5, 6, 7)))
        assert len(transport.writes) == 1  # three replies, one write, no loop turn in between
        body = memoryview(transport.writes[0])
        ids, off = [], 0
        while off < len(body):
            (n,) = wire.LENGTH.unpack_from(body, off)
            ids.append(wire.decoder.decode(body[off + 4 : off + 4 + n]).id)
            off += 4 + n
        assert ids == [5, 6, 7]
        # and no write left queued for the next turn: one sent outside a read is, and goes out then
        scheduled = []
        loop = conn.channel.loop
        conn.channel.loop = type("Loop", (), {"call_soon": lambda self, f: scheduled.append(f)})()
        conn.channel.data_received(wire.frame(_infer(8, "at_once")))
        assert len(transport.writes) == 2 and not scheduled
        conn.channel.send(wire.Free(["a-slab"]))
        assert len(transport.writes) == 2 and len(scheduled) == 1
        scheduled[0]()
        assert len(transport.writes) == 3
        conn.channel.loop = loop
