"""scheduling/handoff.py: callbacks posted from threads run on the loop in order, one loop wakeup per burst."""

from __future__ import annotations

import asyncio
import threading

from naiad.scheduling.handoff import Handoff


def test_a_burst_from_a_thread_runs_in_order_with_one_wakeup():
    async def main():
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop)
        wakeups = []
        original = loop.call_soon_threadsafe

        def counting(cb, *args):
            wakeups.append(cb)
            return original(cb, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        got: list[int] = []
        done = asyncio.Event()

        def take(i: int) -> None:
            got.append(i)
            if i == 999:
                done.set()

        posted = threading.Event()

        def producer():
            for i in range(1000):  # the loop is blocked on `posted` meanwhile: all of them are one burst
                handoff.post(take, i)
            posted.set()

        t = threading.Thread(target=producer)
        t.start()
        posted.wait()  # (blocks the loop on purpose)
        await asyncio.wait_for(done.wait(), 10)
        t.join()
        assert got == list(range(1000))
        assert len(wakeups) == 1

        # after a drain the next post wakes the loop again
        again = asyncio.Event()
        threading.Thread(target=handoff.post, args=(lambda _: again.set(), None)).start()
        await asyncio.wait_for(again.wait(), 10)
        assert len(wakeups) == 2

    asyncio.run(main())


def test_a_failing_callback_does_not_stop_the_others():
    async def main():
        handoff = Handoff(asyncio.get_running_loop())
        got: list[str] = []
        done = asyncio.Event()

        def boom(_):
            raise ValueError("boom")

        handoff.post(boom, None)
        handoff.post(got.append, "after")
        handoff.post(lambda _: done.set(), None)
        await asyncio.wait_for(done.wait(), 10)
        assert got == ["after"]

    asyncio.run(main())


def test_posts_racing_the_drain_are_never_lost():
    """Two threads post while the loop drains: every item arrives (no wakeup is lost between a drain's last look
    and the flag it cleared)."""

    async def main():
        handoff = Handoff(asyncio.get_running_loop())
        n = 20000
        got: list[int] = []
        done = asyncio.Event()

        def take(i: int) -> None:
            got.append(i)
            if len(got) == 2 * n:
                done.set()

        def producer(base: int):
            for i in range(n):
                handoff.post(take, base + i)

        threads = [threading.Thread(target=producer, args=(k * n,)) for k in range(2)]
        for t in threads:
            t.start()
        await asyncio.wait_for(done.wait(), 30)
        for t in threads:
            t.join()
        assert sorted(got) == list(range(2 * n))
        for k in range(2):  # each thread's items in its own order
            mine = [i for i in got if k * n <= i < (k + 1) * n]
            assert mine == sorted(mine)

    asyncio.run(main())
