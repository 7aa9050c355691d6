"""Pass runner: one pass per pool at a time, concurrent requests coalesced, errors handed to waiters."""

from __future__ import annotations

import asyncio

import pytest

from naiad_operator.runner import PassRunner

on_session_loop = pytest.mark.asyncio(loop_scope="session")


class Recorder:
    def __init__(self, fail: bool = False):
        self.started: list[tuple[str, str]] = []
        self.running = 0
        self.max_running = 0
        self.release = asyncio.Event()
        self.fail = fail

    async def __call__(self, namespace: str, pool: str) -> int:
        self.started.append((namespace, pool))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self.release.wait()
            if self.fail:
                raise RuntimeError("api down")
            return len(self.started)
        finally:
            self.running -= 1


@on_session_loop
async def test_requests_during_a_pass_share_the_next_one():
    recorder = Recorder()
    runner = PassRunner(recorder)
    first = asyncio.create_task(runner.run("ns", "pool"))
    await asyncio.sleep(0.01)  # the first pass is running now
    waiters = [asyncio.create_task(runner.run("ns", "pool")) for _ in range(5)]
    runner.request("ns", "pool")
    await asyncio.sleep(0.01)
    recorder.release.set()
    assert await first == 1
    assert await asyncio.gather(*waiters) == [2] * 5  # all five saw the same, second pass
    assert recorder.started == [("ns", "pool")] * 2
    assert recorder.max_running == 1
    await runner.close()


@on_session_loop
async def test_pools_run_independently():
    recorder = Recorder()
    runner = PassRunner(recorder)
    a = asyncio.create_task(runner.run("ns", "a"))
    b = asyncio.create_task(runner.run("ns", "b"))
    await asyncio.sleep(0.01)
    assert recorder.max_running == 2
    recorder.release.set()
    await asyncio.gather(a, b)
    await runner.close()


@on_session_loop
async def test_errors_reach_waiters_and_requests_only_log(caplog):
    recorder = Recorder(fail=True)
    recorder.release.set()
    runner = PassRunner(recorder)
    with pytest.raises(RuntimeError, match="api down"):
        await runner.run("ns", "pool")
    runner.request("ns", "pool")
    await asyncio.sleep(0.05)
    assert "placement pass for ns/pool failed: api down" in caplog.text
    await runner.close()


@on_session_loop
async def test_a_cancelled_waiter_does_not_cancel_the_pass():
    recorder = Recorder()
    runner = PassRunner(recorder)
    waiter = asyncio.create_task(runner.run("ns", "pool"))
    await asyncio.sleep(0.01)
    waiter.cancel()
    await asyncio.sleep(0.01)
    recorder.release.set()
    assert await runner.run("ns", "pool") == 2  # the first pass finished, then a fresh one ran
    await runner.close()
