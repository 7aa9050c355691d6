"""The model-control client against a tiny aiohttp server that answers like Triton's explicit-mode endpoints."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from naiad_operator.control import (
    IndexEntry,
    ModelControlClient,
    ModelControlError,
    ServerUnreachable,
    base_url,
)

# Fixtures run on the session loop (pyproject: asyncio_default_fixture_loop_scope), so the tests do too.
on_session_loop = pytest.mark.asyncio(loop_scope="session")


class FakeServer:
    """Repository with models a, b, broken; explicit model control; records the load bodies it received."""

    def __init__(self):
        self.states = {"a": "UNAVAILABLE", "b": "UNAVAILABLE", "broken": "UNAVAILABLE"}
        self.load_bodies: list[dict] = []
        self.ready = True
        self.delay = 0.0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v2/health/live", self.live)
        app.router.add_get("/v2/health/ready", self.health_ready)
        app.router.add_post("/v2/repository/index", self.index)
        app.router.add_post("/v2/repository/models/{model}/load", self.load)
        app.router.add_post("/v2/repository/models/{model}/unload", self.unload)
        return app

    async def live(self, request):
        return web.Response(status=200)

    async def health_ready(self, request):
        return web.Response(status=200 if self.ready else 503)

    async def index(self, request):
        await asyncio.sleep(self.delay)
        body = await request.json()
        entries = [
            {"name": n, "version": "1", "state": s, "reason": "" if s == "READY" else "unloaded"}
            for n, s in sorted(self.states.items())
        ]
        if body.get("ready"):
            entries = [e for e in entries if e["state"] == "READY"]
        return web.json_response(entries)

    async def load(self, request):
        name = request.match_info["model"]
        text = await request.text()
        self.load_bodies.append(json.loads(text) if text else {})
        if name not in self.states:
            return web.json_response(
                {"error": f"failed to load '{name}', failed to poll from model repository"}, status=400
            )
        if name == "broken":
            return web.json_response(
                {"error": "load failed for model 'broken': version 1 is at UNAVAILABLE"}, status=400
            )
        self.states[name] = "READY"
        return web.Response(status=200)

    async def unload(self, request):
        name = request.match_info["model"]
        if name not in self.states:
            return web.json_response({"error": f"failed to unload '{name}', model not found"}, status=400)
        if name == "broken":
            return web.json_response({"error": "unload timed out"}, status=400)
        self.states[name] = "UNAVAILABLE"
        return web.Response(status=200)


@pytest.fixture
async def served():
    fake = FakeServer()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    async with aiohttp.ClientSession() as session:
        yield fake, ModelControlClient(session, port=port, request_timeout=1.0, load_timeout=2.0)
    await runner.cleanup()


@on_session_loop
async def test_health(served):
    fake, client = served
    assert await client.live("127.0.0.1")
    assert await client.ready("127.0.0.1")
    fake.ready = False
    assert not await client.ready("127.0.0.1")


@on_session_loop
async def test_index_lists_every_model_with_state(served):
    _fake, client = served
    entries = await client.index("127.0.0.1")
    assert entries == [
        IndexEntry("a", "1", "UNAVAILABLE", "unloaded"),
        IndexEntry("b", "1", "UNAVAILABLE", "unloaded"),
        IndexEntry("broken", "1", "UNAVAILABLE", "unloaded"),
    ]
    assert not any(e.ready for e in entries)


@on_session_loop
async def test_load_sends_the_config_override_as_a_json_string(served):
    fake, client = served
    await client.load(
        "127.0.0.1", "a", {"max_batch_size": 8, "version_policy": {"specific": {"versions": [1]}}}
    )
    await client.load("127.0.0.1", "b")
    assert fake.states["a"] == "READY" and fake.states["b"] == "READY"
    config = json.loads(fake.load_bodies[0]["parameters"]["config"])
    assert config == {"max_batch_size": 8, "version_policy": {"specific": {"versions": [1]}}}
    assert fake.load_bodies[1] == {}  # no override: no body
    ready = [e.name for e in await client.index("127.0.0.1") if e.ready]
    assert ready == ["a", "b"]


@on_session_loop
async def test_load_failure_carries_the_server_message(served):
    _, client = served
    with pytest.raises(ModelControlError) as error:
        await client.load("127.0.0.1", "broken")
    assert error.value.status == 400 and "version 1 is at UNAVAILABLE" in str(error.value)


@on_session_loop
async def test_unload_and_not_found_counts_as_done(served):
    fake, client = served
    await client.load("127.0.0.1", "a")
    await client.unload("127.0.0.1", "a")
    assert fake.states["a"] == "UNAVAILABLE"
    await client.unload("127.0.0.1", "never-existed")  # "model not found": nothing to unload
    with pytest.raises(ModelControlError, match="unload timed out"):
        await client.unload("127.0.0.1", "broken")


@on_session_loop
async def test_unreachable_and_slow_servers():
    async with aiohttp.ClientSession() as session:
        client = ModelControlClient(session, port=1, request_timeout=0.5)
        with pytest.raises(ServerUnreachable):
            await client.index("127.0.0.1")
        assert not await client.live("127.0.0.1")


@on_session_loop
async def test_timeout_is_reported_as_unreachable(served):
    fake, client = served
    fake.delay = 2.0
    with pytest.raises(ServerUnreachable):
        await client.index("127.0.0.1")


def test_base_url_brackets_ipv6():
    assert base_url("10.1.2.3") == "http://10.1.2.3:8000"
    assert base_url("fd00::1", 9000) == "http://[fd00::1]:9000"
    assert base_url("server.ns.svc") == "http://server.ns.svc:8000"
