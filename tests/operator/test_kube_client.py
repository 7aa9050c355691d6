"""The operator's small Kubernetes client on the wire: paths, server-side apply parameters, content types,
credentials and re-login on 401, error mapping. A recording HTTP server stands in for the transport only."""

from __future__ import annotations

import json

import kopf
import pytest
from aiohttp import web

from naiad_operator.kube import KubeClient, KubeError, resource_path

on_session_loop = pytest.mark.asyncio(loop_scope="session")


def test_resource_paths():
    assert resource_path("v1", "Pod", "ml", "p", "status") == "/api/v1/namespaces/ml/pods/p/status"
    assert resource_path("apps/v1", "Deployment", "ml") == "/apis/apps/v1/namespaces/ml/deployments"
    assert (
        resource_path("naiad.dev/v1alpha1", "InferenceModel", "ml", "m")
        == "/apis/naiad.dev/v1alpha1/namespaces/ml/inferencemodels/m"
    )
    assert (
        resource_path("autoscaling/v2", "HorizontalPodAutoscaler", "ml", "h")
        == "/apis/autoscaling/v2/namespaces/ml/horizontalpodautoscalers/h"
    )


class Recorder:
    def __init__(self):
        self.requests: list[dict] = []
        self.valid_token = "t1"
        self.answers: dict[tuple[str, str], tuple[int, object]] = {}

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.text()
        self.requests.append(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "content_type": request.headers.get("Content-Type"),
                "auth": request.headers.get("Authorization"),
                "body": json.loads(body) if body else None,
            }
        )
        if request.headers.get("Authorization") != f"Bearer {self.valid_token}":
            return web.json_response(
                {"kind": "Status", "reason": "Unauthorized", "message": "bad token"}, status=401
            )
        status, payload = self.answers.get((request.method, request.path), (200, {"kind": "Ok"}))
        return web.json_response(payload, status=status)


@pytest.fixture
async def api():
    recorder = Recorder()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    tokens = iter(["t0", "t1", "t2"])
    logins = []

    async def login() -> kopf.ConnectionInfo:
        token = next(tokens)
        logins.append(token)
        return kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}", token=token)

    client = KubeClient(login)
    yield recorder, client, logins
    await client.close()
    await runner.cleanup()


@on_session_loop
async def test_server_side_apply_and_relogin_on_401(api):
    recorder, client, logins = api
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpu", "namespace": "ml"},
        "spec": {},
    }
    await client.apply(body)
    assert logins == ["t0", "t1"]  # the first token was refused, a fresh login succeeded
    last = recorder.requests[-1]
    assert last["method"] == "PATCH" and last["path"] == "/apis/apps/v1/namespaces/ml/deployments/gpu"
    assert last["query"] == {"fieldManager": "naiad-operator", "force": "true"}
    assert last["content_type"] == "application/apply-patch+yaml"
    assert last["body"] == body and last["auth"] == "Bearer t1"


@on_session_loop
async def test_patches_status_and_delete(api):
    recorder, client, _ = api
    recorder.valid_token = "t0"
    await client.patch("v1", "Pod", "ml", "p", {"metadata": {"labels": {"a": None}}})
    assert recorder.requests[-1]["content_type"] == "application/merge-patch+json"
    await client.patch(
        "v1", "Pod", "ml", "p", {"status": {"conditions": []}}, subresource="status", patch_type="strategic"
    )
    assert recorder.requests[-1]["path"] == "/api/v1/namespaces/ml/pods/p/status"
    assert recorder.requests[-1]["content_type"] == "application/strategic-merge-patch+json"
    await client.apply_status("naiad.dev/v1alpha1", "InferenceModel", "ml", "m", {"phase": "Available"})
    assert recorder.requests[-1]["body"] == {"status": {"phase": "Available"}}
    assert recorder.requests[-1]["path"].endswith("/inferencemodels/m/status")
    recorder.answers[("DELETE", "/api/v1/namespaces/ml/services/gone")] = (404, {"reason": "NotFound"})
    assert await client.delete("v1", "Service", "ml", "gone") is False
    assert await client.delete("v1", "Service", "ml", "here") is True
    assert recorder.requests[-1]["body"] == {"propagationPolicy": "Background"}


@on_session_loop
async def test_get_list_and_errors(api):
    recorder, client, _ = api
    recorder.valid_token = "t0"
    recorder.answers[("GET", "/api/v1/namespaces/ml/pods/missing")] = (404, {"reason": "NotFound"})
    assert await client.get("v1", "Pod", "ml", "missing") is None
    recorder.answers[("GET", "/api/v1/namespaces/ml/pods")] = (200, {"items": [{"metadata": {"name": "a"}}]})
    assert await client.list("v1", "Pod", "ml", "naiad.dev/server=gpu") == [{"metadata": {"name": "a"}}]
    assert recorder.requests[-1]["query"] == {"labelSelector": "naiad.dev/server=gpu"}
    recorder.answers[("PATCH", "/api/v1/namespaces/ml/services/bad")] = (
        422,
        {"reason": "Invalid", "message": "spec.ports: Required value"},
    )
    with pytest.raises(KubeError) as error:
        await client.apply(
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "bad", "namespace": "ml"}}
        )
    assert error.value.status == 422 and not error.value.retriable and "Required value" in error.value.message
    recorder.answers[("GET", "/api/v1/namespaces/ml/pods/busy")] = (503, {"reason": "ServiceUnavailable"})
    with pytest.raises(KubeError) as error:
        await client.get("v1", "Pod", "ml", "busy")
    assert error.value.retriable


@on_session_loop
async def test_api_discovery_is_cached(api):
    recorder, client, _ = api
    recorder.valid_token = "t0"
    recorder.answers[("GET", "/apis/monitoring.coreos.com/v1")] = (
        200,
        {"resources": [{"name": "servicemonitors"}]},
    )
    assert await client.api_available("monitoring.coreos.com/v1", "servicemonitors")
    calls = len(recorder.requests)
    assert await client.api_available("monitoring.coreos.com/v1", "servicemonitors")
    assert len(recorder.requests) == calls
    recorder.answers[("GET", "/apis/other.dev/v1")] = (404, {"reason": "NotFound"})
    assert not await client.api_available("other.dev/v1", "things")
    # an API installed later (KEDA after the operator) is seen once the shorter cache of a "no" runs out
    recorder.answers[("GET", "/apis/other.dev/v1")] = (200, {"resources": [{"name": "things"}]})
    assert not await client.api_available("other.dev/v1", "things")
    assert await client.api_available("other.dev/v1", "things", missing_ttl=0)


@on_session_loop
async def test_unreachable_api_is_a_retriable_error():
    async def login() -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server="http://127.0.0.1:1", token="x")

    client = KubeClient(login, timeout=2)
    with pytest.raises(KubeError) as error:
        await client.get("v1", "Pod", "ml", "p")
    assert error.value.status == 0 and error.value.retriable
    await client.close()
