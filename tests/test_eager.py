"""frontends/transport/eager.Starter: a request coroutine runs at once, and a Task takes over only if it waits."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from naiad.frontends.transport import eager

var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="outside")


async def test_a_coroutine_that_never_waits_finishes_inside_start_without_a_task():
    seen = []

    async def inner():
        return 7

    async def request():
        seen.append(await inner())

    before = len(asyncio.all_tasks())
    assert eager.Starter().start(asyncio.get_running_loop(), request()) is None
    assert seen == [7]
    assert len(asyncio.all_tasks()) == before


async def test_a_coroutine_that_waits_is_resumed_by_a_task_with_the_futures_result():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    steps = []

    async def request():
        steps.append("before")
        steps.append(await fut)
        await asyncio.sleep(0)  # a bare yield on the way
        steps.append("after")
        return "done"

    task = eager.Starter().start(loop, request())
    assert steps == ["before"] and isinstance(task, asyncio.Task)
    # the Task shows the request's coroutine as its own: in its repr and in its stack (asyncio.all_tasks dumps)
    assert "request()" in repr(task) and task.get_stack()[0].f_code.co_name == "request"
    loop.call_later(0.01, fut.set_result, 42)
    assert await asyncio.wait_for(task, 5) == "done"
    assert steps == ["before", 42, "after"]


@pytest.mark.parametrize("outcome", ["error", "cancelled"])
async def test_the_coroutine_reads_a_failed_or_cancelled_future_itself(outcome):
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    caught = []

    async def request():
        try:
            await fut
        except (ValueError, asyncio.CancelledError) as exc:
            caught.append(type(exc))
        return "handled"

    task = eager.Starter().start(loop, request())
    if outcome == "error":
        fut.set_exception(ValueError("model failed"))
    else:
        fut.cancel()
    assert await asyncio.wait_for(task, 5) == "handled"
    assert caught == [ValueError if outcome == "error" else asyncio.CancelledError]


async def test_the_coroutine_runs_in_a_context_of_its_own_before_and_after_it_waits():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    values = []

    async def request():
        var.set("request")
        await fut
        values.append(var.get())

    task = eager.Starter().start(loop, request())
    assert var.get() == "outside"  # what the request set stays in its context
    fut.set_result(None)
    await task
    assert values == ["request"]


async def test_an_exception_that_ends_the_coroutine_early_goes_to_the_loops_exception_handler():
    loop = asyncio.get_running_loop()
    reported = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context["exception"]))
    try:

        async def request():
            raise KeyError("bug")

        assert eager.Starter().start(loop, request()) is None
    finally:
        loop.set_exception_handler(previous)
    assert len(reported) == 1 and isinstance(reported[0], KeyError)


@pytest.mark.parametrize("when", ["waiting", "before_its_first_step"])
async def test_cancelling_the_task_cancels_what_the_coroutine_waits_on_and_reaches_the_coroutine(when):
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    seen = []

    async def request():
        try:
            await fut
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    task = eager.Starter().start(loop, request())
    assert task is not None
    if when == "waiting":
        await asyncio.sleep(0)  # the Task now waits on the future
    # else in the same turn, before the Task's first step (a connection lost at once): the coroutine started
    # already, so the cancellation must still reach it where it waits
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled() and seen == ["cancelled"]


async def test_a_cancellation_that_arrives_after_the_future_is_done_still_reaches_the_coroutine():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    seen = []

    async def request():
        try:
            await fut
            seen.append("resumed")
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    task = eager.Starter().start(loop, request())
    await asyncio.sleep(0)
    fut.set_result(None)  # the Task is now scheduled to resume the coroutine ...
    task.cancel()  # ... and is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled"]


async def test_only_the_first_request_of_a_loop_turn_starts_at_once():
    loop = asyncio.get_running_loop()
    starter = eager.Starter()
    steps = []

    async def request(tag):
        steps.append(tag)
        return tag

    assert starter.start(loop, request("first")) is None
    second = starter.start(loop, request("second"))  # same turn: a Task of its own, run by the loop
    assert steps == ["first"] and isinstance(second, asyncio.Task)
    assert await second == "second"
    await asyncio.sleep(0)  # the loop has turned
    assert starter.start(loop, request("third")) is None
    assert steps == ["first", "second", "third"]
