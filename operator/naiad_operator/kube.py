"""A small async Kubernetes API client (aiohttp) for the few calls the operator makes itself: get, list,
server-side apply, patch, delete. It authenticates with the same kopf.ConnectionInfo that kopf logged in with.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import kopf

from .naming import API_VERSION, FIELD_MANAGER, MODEL_KIND, MODEL_PLURAL, SERVER_KIND, SERVER_PLURAL
from .objects import Body

# Every kind the operator reads or writes, with its resource name (no discovery needed for these).
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Pod"): "pods",
    ("v1", "Service"): "services",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("v1", "Secret"): "secrets",
    ("discovery.k8s.io/v1", "EndpointSlice"): "endpointslices",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "ReplicaSet"): "replicasets",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
    ("http.keda.sh/v1alpha1", "HTTPScaledObject"): "httpscaledobjects",
    (API_VERSION, SERVER_KIND): SERVER_PLURAL,
    (API_VERSION, MODEL_KIND): MODEL_PLURAL,
}

PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "apply": "application/apply-patch+yaml",
    "json": "application/json-patch+json",
}


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def retriable(self) -> bool:
        """Errors that pass with time (throttling, server trouble, conflicts), as opposed to invalid objects."""
        return self.status in (0, 409, 429) or self.status >= 500


def resource_path(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    plural = PLURALS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = prefix + (f"/namespaces/{quote(namespace)}" if namespace else "") + f"/{plural}"
    if name is not None:
        path += f"/{quote(name)}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


@dataclass
class _Session:
    server: str
    session: aiohttp.ClientSession


class KubeClient:
    """Calls the API server with credentials from `login` (re-run once when the server answers 401)."""

    def __init__(self, login: Callable[[], Awaitable[kopf.ConnectionInfo]], *, timeout: float = 30.0):
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._current: _Session | None = None
        self._lock = asyncio.Lock()
        self._discovery: dict[str, tuple[float, bool]] = {}

    @classmethod
    def from_info(cls, info: kopf.ConnectionInfo, **kwargs: Any) -> KubeClient:
        async def fixed() -> kopf.ConnectionInfo:
            return info

        return cls(fixed, **kwargs)

    async def _session(self, renew: bool = False) -> _Session:
        async with self._lock:
            if self._current is not None and not renew:
                return self._current
            info = await self._login()
            if self._current is not None:
                await self._current.session.close()
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
                headers={**info.as_http_headers(), "User-Agent": "naiad-operator"},
                timeout=self._timeout,
                trust_env=info.trust_env,
            )
            self._current = _Session(info.server.rstrip("/"), session)
            return self._current

    async def close(self) -> None:
        async with self._lock:
            if self._current is not None:
                await self._current.session.close()
                self._current = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        """JSON in, JSON out; KubeError for any non-2xx answer (status 0 for a connection failure)."""
        renewed = False
        while True:
            current = await self._session(renew=renewed)
            url = current.server + path + (f"?{urlencode(query)}" if query else "")
            data = None if body is None else json.dumps(body)
            headers = (
                {"Content-Type": content_type, "Accept": "application/json"}
                if data is not None
                else {"Accept": "application/json"}
            )
            try:
                async with current.session.request(method, url, data=data, headers=headers) as response:
                    text = await response.text()
                    status = response.status
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
                raise KubeError(
                    0, "Unreachable", f"{method} {path}: {error.__class__.__name__}: {error}"
                ) from error
            if status == 401 and not renewed:
                renewed = True
                continue
            if status >= 300:
                try:
                    problem = json.loads(text)
                    reason, message = str(problem.get("reason", "")), str(problem.get("message", text))
                except ValueError:
                    reason, message = "", text
                raise KubeError(status, reason or str(status), message)
            return json.loads(text) if text else None

    # --- typed helpers ------------------------------------------------------------------------------------------

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Body | None:
        try:
            return await self.request("GET", resource_path(api_version, kind, namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str | None = None
    ) -> list[Body]:
        query = {"labelSelector": label_selector} if label_selector else None
        result = await self.request("GET", resource_path(api_version, kind, namespace), query=query)
        return list(result.get("items") or [])

    async def apply(self, body: Mapping[str, Any]) -> Body:
        """Server-side apply as the operator's field manager; forced, since the operator owns these fields."""
        meta = body["metadata"]
        path = resource_path(body["apiVersion"], body["kind"], meta.get("namespace"), meta["name"])
        return await self.request(
            "PATCH",
            path,
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=body,
            content_type=PATCH_TYPES["apply"],
        )

    async def apply_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> Body:
        """Merge-patch the status subresource."""
        path = resource_path(api_version, kind, namespace, name, "status")
        return await self.request("PATCH", path, body={"status": status}, content_type=PATCH_TYPES["merge"])

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> Body:
        path = resource_path(api_version, kind, namespace, name, subresource)
        return await self.request("PATCH", path, body=patch, content_type=PATCH_TYPES[patch_type])

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete in the background (children go through garbage collection); False when already gone."""
        try:
            await self.request(
                "DELETE",
                resource_path(api_version, kind, namespace, name),
                body={"propagationPolicy": "Background"},
            )
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def api_available(
        self, group_version: str, plural: str, ttl: float = 300.0, missing_ttl: float = 30.0
    ) -> bool:
        """Whether the cluster serves `plural` in `group_version` (e.g. ServiceMonitors), cached for `ttl`; an
        answer of no for `missing_ttl` only, so that an API installed after the operator started is used soon."""
        key = f"{group_version}/{plural}"
        cached = self._discovery.get(key)
        if cached is not None and time.monotonic() - cached[0] < (ttl if cached[1] else missing_ttl):
            return cached[1]
        prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        try:
            listing = await self.request("GET", prefix)
            found = any(r.get("name") == plural for r in listing.get("resources") or [])
        except KubeError as error:
            if error.status not in (403, 404, 503):
                raise
            found = False
        self._discovery[key] = (time.monotonic(), found)
        return found
