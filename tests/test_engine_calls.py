"""engine/calls.py: the calls a frontend worker makes of the engine are EngineCalls methods, looked up by name in
CALLS; every call a worker makes (engine/client.py, engine/remote_shm.py) is in that table, a coroutine method runs
as one, and a call the engine does not know is answered with InvalidArgument on either channel."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest
from helpers import ROOT

from naiad.engine.calls import CALLS, EngineCalls
from naiad.engine.client import ControlChannel, EngineClient
from naiad.engine.core import EngineService
from naiad.errors import InvalidArgument
from naiad.shared_memory.system import SharedMemoryManager

WORKER_MODULES = ("engine/client.py", "engine/remote_shm.py")


def _calls_made(relative: str) -> set[str]:
    """Every `EngineCalls.<name>` a module names."""
    tree = ast.parse((ROOT / "server" / "naiad" / relative).read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "EngineCalls"
    }


def test_every_call_a_worker_makes_is_in_the_table():
    made = set().union(*(_calls_made(m) for m in WORKER_MODULES))
    assert made, "the worker's modules name no EngineCalls method"
    assert made <= set(CALLS), f"not engine calls: {sorted(made - set(CALLS))}"
    # and the table holds nothing a worker never asks for
    assert set(CALLS) == made, f"engine calls no worker makes: {sorted(set(CALLS) - made)}"


def test_the_table_is_the_methods_by_name():
    for name, call in CALLS.items():
        assert getattr(EngineCalls, name) is call.fn
        assert call.is_async == asyncio.iscoroutinefunction(call.fn)
    assert CALLS["index"].is_async and CALLS["ready_model"].is_async and CALLS["load_model"].is_async
    assert not CALLS["live"].is_async and not CALLS["model_info"].is_async


class _Tracer:
    active = False


class _Server:
    tracer = _Tracer()

    def live(self) -> bool:
        return True

    def metadata(self) -> dict:
        return {"name": "naiad", "version": "test", "extensions": []}


@contextlib.contextmanager
def _engine() -> Iterator[EngineService]:
    """An engine on its own event loop thread (the control channel's calls block)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = EngineService(_Server(), SharedMemoryManager(enabled=True))  # type: ignore[arg-type]
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result(10)
    try:
        yield engine
    finally:
        asyncio.run_coroutine_threadsafe(engine.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def no_such_call() -> None:
    """A function named as no engine call is."""


async def test_an_unknown_call_is_answered_with_invalid_argument():
    with _engine() as engine:
        control = ControlChannel(engine.path)
        assert control.call(EngineCalls.live) is True
        with pytest.raises(InvalidArgument, match="unknown engine call 'no_such_call'"):
            control.call(no_such_call)
        control.sock.close()
        client = EngineClient(engine.path)
        await client.connect()
        try:
            assert await client.call(EngineCalls.live) is True
            with pytest.raises(InvalidArgument, match="unknown engine call 'no_such_call'"):
                await client.call(no_such_call)
        finally:
            client.close()
            client.control.sock.close()
