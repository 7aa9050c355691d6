"""SIGTERM and SIGINT acted on whatever the event loop is doing, and the process's exit within its exit timeout.

asyncio runs a signal's handler on the loop, so a loop busy with one request (a C call that does not return, a long
stretch of Python) would neither start the drain nor ever exit. Here a thread of its own reads the signals from
the process's wakeup fd (the C-level handler writes the signal's number there at once), asks the loop to stop, and
arms a deadline: if the process is still running `exit_timeout` seconds after the first SIGTERM, it ends itself
(status 1), as the kubelet's SIGKILL would, but before it and with a line in the log. SIGHUP (reopen the log
file) is handed to the loop the same way. Later SIGTERMs and SIGINTs change nothing: a process group's stop
(Ctrl-C, `timeout`, a pod's) may bring both at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable

EXIT_STATUS = 1  # the deadline passed: not the clean exit of a drained server
EXIT_MARGIN_S = 0.5  # the deadline's lead on --exit-timeout-secs (at most a tenth of it)


def _ignore(signum: int, frame: object) -> None:  # the Python-level handler: the thread does the work
    return None


class StopSignals:
    """Owns SIGTERM, SIGINT and SIGHUP for a process whose main thread runs `loop` (install from that thread)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        stop: Callable[[], None],
        exit_timeout: float,
        hangup: Callable[[], None] | None = None,
        name: str = "naiad",
    ):
        self.loop = loop
        self.stop = stop
        self.exit_timeout = exit_timeout
        self.hangup = hangup
        self.name = name
        self.stopping_since: float | None = None
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous: dict[int, object] = {}
        self._previous_fd = -1
        self._closed = False

    def install(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._previous[sig] = signal.signal(sig, _ignore)
        # the loop's own wakeup fd (uvloop's, asyncio's) is replaced: no loop signal handler is used here
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name=f"{self.name}-signals", daemon=True).start()
        return self

    def close(self) -> None:
        """Give the signals back (the deadline, once armed, stays: the process is on its way out)."""
        if self._closed:
            return
        self._closed = True
        try:
            signal.set_wakeup_fd(self._previous_fd)
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
        except ValueError:  # not the main thread any more (interpreter shutdown)
            pass
        os.close(self._write_fd)  # the watching thread reads EOF and ends

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except InterruptedError:
                continue
            if not data:
                os.close(self._read_fd)
                return
            for signum in data:
                self._received(signum)

    def _received(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            if self.hangup is not None:
                self._on_loop(self.hangup)
            return
        if signum not in (signal.SIGTERM, signal.SIGINT):
            return
        if self.stopping_since is not None:
            return
        self.stopping_since = time.monotonic()
        self._on_loop(self.stop)
        threading.Thread(target=self._deadline, name=f"{self.name}-exit-deadline", daemon=True).start()

    def _on_loop(self, fn: Callable[[], None]) -> None:
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is closed: the process is exiting anyway
            pass

    def _deadline(self) -> None:
        # a little before the timeout: ending a process that holds a model's memory takes the kernel a while, and
        # on a busy node this thread waits for a CPU too (0.7 s past a 3 s timeout was seen on 2 loaded cores)
        time.sleep(max(0.0, self.exit_timeout - min(EXIT_MARGIN_S, self.exit_timeout / 10)))
        self._exit(
            f"still running at the end of --exit-timeout-secs ({self.exit_timeout:g}s) after SIGTERM: exiting now"
        )

    def _exit(self, why: str) -> None:
        # no logging call: the thread that holds the logging lock may be the one that never returns
        try:
            os.write(2, f"{self.name}: {why}\n".encode())
        finally:
            os._exit(EXIT_STATUS)
