"""backends/python/exec_watch.ExecWatch: the event loop reads the replies it expects on an exec channel registered
once, leaves a reply it does not expect to the thread that does, and closes the channel on the loop."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import uvloop

from naiad.backends.python.exec_watch import ExecWatch
from naiad.backends.python.wire import Channel


def _run(coro) -> None:
    uvloop.run(coro)  # as `naiad serve` runs (its poller leaves a watched descriptor non-blocking)


def _watched() -> tuple[ExecWatch, socket.socket]:
    """A watch on our end of a socket pair (on the running loop), and the worker's end."""
    ours, theirs = socket.socketpair()
    return ExecWatch(asyncio.get_running_loop(), Channel(ours)), theirs


def _expect(watch: ExecWatch) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()

    def on_reply(message, error):
        if error is None:
            fut.set_result(message)
        else:
            fut.set_exception(error)

    watch.expect(on_reply)
    return fut


def test_replies_are_read_with_one_registration():
    async def main():
        watch, theirs = _watched()
        worker = Channel(theirs)
        for i in range(5):
            fut = _expect(watch)
            worker.send(("reply", i, None))
            assert await asyncio.wait_for(fut, 5) == ("reply", i, None)
            assert watch.registered  # stays registered between exchanges
        watch.close()
        worker.close()

    _run(main())


def test_a_reply_nobody_expects_is_left_to_the_thread_and_ends_the_registration():
    async def main():
        watch, theirs = _watched()
        worker = Channel(theirs)
        channel = watch.channel
        fut = _expect(watch)
        worker.send(("reply", "loop", None))
        assert await asyncio.wait_for(fut, 5) == ("reply", "loop", None)
        # the instance thread's exchange: its reply arrives while the loop still watches the socket
        worker.send(("reply", "thread", None))
        await asyncio.sleep(0.05)
        assert not watch.registered  # the loop saw it arrive and stepped aside, without reading it
        channel.sock.setblocking(True)
        got = await asyncio.wait_for(asyncio.to_thread(channel.recv), 5)
        assert got == ("reply", "thread", None)
        fut = _expect(watch)  # the next exchange on the loop registers again
        worker.send(("reply", "again", None))
        assert await asyncio.wait_for(fut, 5) == ("reply", "again", None) and watch.registered
        watch.close()
        worker.close()

    _run(main())


@pytest.mark.parametrize("closer", ["loop", "thread"])
def test_close_unregisters_on_the_loop_and_fails_what_was_expected(closer):
    async def main():
        watch, theirs = _watched()
        ours = watch.channel.sock
        fut = _expect(watch)
        assert watch.registered
        if closer == "loop":
            watch.close()
        else:
            thread = threading.Thread(target=watch.close)
            thread.start()
            thread.join()
        with pytest.raises(EOFError):
            await asyncio.wait_for(fut, 5)
        assert not watch.registered and ours.fileno() == -1  # closed by the loop, after unregistering
        # the next socket may get the same descriptor number: a watch on it is polled afresh
        again, peer = _watched()
        fut = _expect(again)
        Channel(peer).send(("reply", "new", None))
        assert await asyncio.wait_for(fut, 5) == ("reply", "new", None)
        again.close()
        peer.close()
        theirs.close()

    _run(main())


def test_the_workers_end_fails_the_expected_reply():
    async def main():
        watch, theirs = _watched()
        fut = _expect(watch)
        theirs.close()
        with pytest.raises(EOFError):
            await asyncio.wait_for(fut, 5)
        assert not watch.registered
        watch.close()

    _run(main())


def test_a_registration_that_fails_leaves_nothing_expected():
    async def main():
        watch, theirs = _watched()
        channel = watch.channel
        channel.close()  # the descriptor is gone
        called = []
        with pytest.raises(OSError):
            watch.expect(lambda message, error: called.append((message, error)))
        assert not watch.registered and watch._on_reply is None and not called
        theirs.close()

    _run(main())
