"""The engine's frontend workers: N processes started with the server's own arguments, each replaced when it
dies (the others keep their connections), all stopped with the engine."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from .acceptor import Acceptor
from .core import EngineService

log = logging.getLogger("naiad.engine")

RESTART_DELAY_S = 0.5
# glibc returns a freed block of 128 KiB or more to the kernel, so each large request body is read into freshly
# mapped pages and pays a page fault per 4 KiB (measured: 4 MiB requests at c1 cost a worker 7.8 ms of CPU with
# glibc's defaults, 4.5 ms with these). Bodies up to 32 MiB come from the heap instead, and up to 128 MiB of
# freed heap is kept for the next ones. An operator's own GLIBC_TUNABLES wins.
WORKER_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=134217728"


class FrontendWorkers:
    def __init__(self, engine: EngineService, count: int, argv: list[str], acceptor: Acceptor | None = None):
        self.engine = engine
        self.acceptor = acceptor  # --frontend-accept balanced: hands the workers their connections
        self.count = count
        self.argv = argv  # `naiad serve ...` as this process was started
        self.procs: list[asyncio.subprocess.Process | None] = [None] * count
        self._watchers: list[asyncio.Task] = []
        self._stopping = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.returncode is None]

    async def _spawn(self) -> asyncio.subprocess.Process:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("GLIBC_TUNABLES", WORKER_MALLOC)
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "naiad.engine.worker", self.engine.path, *self.argv, env=env
        )

    async def start(self, timeout: float = 60.0) -> None:
        """Start every worker and wait until each listens and has its data channel to the engine."""
        loop = asyncio.get_running_loop()
        if self.acceptor is not None:
            self.acceptor.start()
        for i in range(self.count):
            self.procs[i] = await self._spawn()
        deadline = loop.time() + timeout
        while sum(1 for c in self.engine.connections if c.prefix) < self.count or (
            self.acceptor is not None and self.acceptor.registered() < self.count
        ):
            dead = [p for p in self.procs if p is not None and p.returncode is not None]
            if dead:
                raise OSError(f"a frontend worker exited with status {dead[0].returncode} while starting")
            if loop.time() > deadline:
                raise OSError(f"frontend workers did not start in {timeout:g}s")
            await asyncio.sleep(0.05)
        self._watchers = [loop.create_task(self._watch(i)) for i in range(self.count)]

    async def _watch(self, i: int) -> None:
        while not self._stopping:
            proc = self.procs[i]
            assert proc is not None
            code = await proc.wait()
            if self._stopping:
                return
            log.warning("frontend worker %d (pid %d) exited with %s; starting another", i, proc.pid, code)
            await asyncio.sleep(RESTART_DELAY_S)
            if not self._stopping:
                self.procs[i] = await self._spawn()

    async def stop(self, timeout: float) -> None:
        """SIGTERM every worker (each drains its connections), SIGKILL what is left after `timeout`."""
        self._stopping = True
        for w in self._watchers:
            w.cancel()
        if self.acceptor is not None:  # no new connections; the workers drain theirs
            self.acceptor.close()
        live = [p for p in self.procs if p is not None and p.returncode is None]
        for p in live:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        if not live:
            return
        _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=timeout)
        if pending:
            for p in live:
                if p.returncode is None:
                    p.kill()
            await asyncio.gather(*(p.wait() for p in live), return_exceptions=True)
