"""The event loop's standing watch on a python instance's exec channel: the replies to executions sent from the loop
are read there as they arrive, the channel's socket registered with the loop once rather than for each execution."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import Any

from .wire import Channel, FrameReader

OnReply = Callable[[Any, BaseException | None], None]


class ExecWatch:
    """Reads the reply of each execution sent from the event loop (`expect`), with the socket registered with the
    loop from the first such execution on. Registering a reader and removing it again for each execution cost
    6.5 us a request (in libuv: a probe, an add and two removes of the descriptor in epoll, and an ioctl).

    The loop reads the socket only while it expects a reply: a reply the instance thread reads itself (a large
    or decoupled execution, `ProcessInstance._call`), or the end of the worker, finds no expectation and
    unregisters the watch instead, which the next `expect` registers again. Close the channel with `close`
    (from any thread): the loop unregisters the descriptor and closes it itself, since a closed descriptor's
    number goes to the next socket while libuv would still hold the old registration."""

    __slots__ = ("_on_reply", "_reader", "channel", "fd", "loop", "registered", "thread")

    def __init__(self, loop: asyncio.AbstractEventLoop, channel: Channel):
        self.loop = loop
        self.channel = channel
        self.fd = channel.sock.fileno()
        self.thread = threading.get_ident()  # the loop's
        self.registered = False
        self._reader: FrameReader | None = None
        self._on_reply: OnReply | None = None

    def expect(self, on_reply: OnReply) -> None:
        """Read the next frame on the loop; then `on_reply(message, None)`, or `on_reply(None, error)` once the
        worker is gone (EOFError, OSError) or its reply does not decode. Call it on the loop."""
        if not self.registered:  # (first: a registration that fails leaves nothing expected)
            self.loop.add_reader(self.fd, self._readable)
            self.registered = True
        self._reader = FrameReader(self.channel.sock)
        self._on_reply = on_reply

    def _readable(self) -> None:
        reader = self._reader
        if reader is None:  # not the loop's to read: stop watching until the next `expect`
            self._unregister()
            return
        try:
            message = reader.feed()
        except Exception as exc:  # the worker is gone, or a reply that does not decode (the stream is lost)
            self._unregister()
            self._reply(None, exc)
            return
        if message is not None:
            self._reply(message, None)

    def _reply(self, message: Any, error: BaseException | None) -> None:
        on_reply = self._on_reply
        self._reader = self._on_reply = None
        if on_reply is not None:
            on_reply(message, error)

    def _unregister(self) -> None:
        if self.registered:
            self.registered = False
            self.loop.remove_reader(self.fd)

    def close(self) -> None:
        """Close the channel (any thread): at once a thread blocked on it wakes, and on the loop the descriptor
        is unregistered, then closed, and an execution still expecting its reply gets EOFError."""
        loop = self.loop
        if loop.is_closed() or not loop.is_running():  # nothing polls it any more (the process is exiting)
            self.channel.close()
            return
        try:
            self.channel.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.get_ident() == self.thread:
            self._close_now()
            return
        try:
            loop.call_soon_threadsafe(self._close_now)
        except RuntimeError:  # the loop closed meanwhile
            self.channel.close()

    def _close_now(self) -> None:
        self._unregister()
        self.channel.close()
        self._reply(None, EOFError("the exec channel was closed"))
