"""Run the kopf operator only while this replica leads (holds the Lease), and serve liveness in both states:
standbys wait for the Lease, a leader that cannot renew stops reconciling and exits, a stopping leader releases
the Lease so a standby takes over within a retry period."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import kopf
from aiohttp import web

from .handlers import connection_info
from .kube import KubeClient
from .leader import ElectionTiming, LeaderElector

log = logging.getLogger(__name__)

# Exit status of a leader that lost its Lease: the pod restarts and comes back as a standby.
LOST_LEASE = 3


def timing_from(raw: str) -> ElectionTiming:
    """'lease,renew,retry' in seconds; '' for the defaults."""
    if not raw.strip():
        return ElectionTiming()
    try:
        lease, renew, retry = (float(part) for part in raw.split(","))
    except ValueError as error:
        raise SystemExit(
            f"--leader-elect-timing wants three numbers 'lease,renew,retry', got {raw!r}"
        ) from error
    try:
        return ElectionTiming(lease_duration=lease, renew_deadline=renew, retry_period=retry)
    except ValueError as error:
        raise SystemExit(str(error)) from error


async def _serve_health(url: str, elector: LeaderElector) -> web.AppRunner | None:
    """GET <path> answers 200 {"leader": ...} while the process runs (standbys are alive, not broken)."""
    if not url:
        return None
    parts = urlsplit(url)

    async def health(_: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps({"leader": elector.leading, "identity": elector.identity}),
            content_type="application/json",
        )

    app = web.Application()
    app.router.add_get(parts.path or "/", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname or "0.0.0.0", parts.port or 8080).start()
    return runner


async def run_elected(
    *,
    namespace: str,
    lease: str,
    timing: ElectionTiming,
    liveness: str,
    clusterwide: bool,
    namespaces: Sequence[str],
) -> int:
    identity = f"{socket.gethostname()}-{secrets.token_hex(3)}"
    kube = KubeClient(lambda: asyncio.to_thread(connection_info, kopf.OperatorSettings()))
    elector = LeaderElector(kube, namespace, lease, identity, timing)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    health = await _serve_health(liveness, elector)
    try:
        acquiring = asyncio.create_task(elector.acquire(), name="naiad-leader-acquire")
        stopping = asyncio.create_task(stop.wait(), name="naiad-stop")
        await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not acquiring.done():
            acquiring.cancel()
            return 0
        stopping.cancel()
        acquiring.result()
        # Created before kopf starts, so kopf leaves it alone when it cancels its own tasks at the end.
        holding = asyncio.create_task(elector.hold(), name="naiad-leader-renew")
        operator = asyncio.create_task(
            kopf.operator(standalone=True, clusterwide=clusterwide, namespaces=namespaces, stop_flag=stop),
            name="naiad-operator",
        )
        done, _ = await asyncio.wait({holding, operator}, return_when=asyncio.FIRST_COMPLETED)
        if operator not in done:
            # Lost the Lease: stop reconciling before a standby's lease duration runs out, then exit.
            stop.set()
            try:
                await asyncio.wait_for(operator, timing.lease_duration - timing.renew_deadline)
            except Exception as error:  # a timeout, or the operator failing while it stops
                log.warning("operator did not stop cleanly after losing the Lease: %r", error)
            return LOST_LEASE
        holding.cancel()
        operator.result()
        return 0
    finally:
        await elector.release()
        if health is not None:
            await health.cleanup()
        await kube.close()
