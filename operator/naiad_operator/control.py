"""Async client of a Naiad (or Triton) server's model-control API: health, repository index, load, unload.

Each call targets one pod by IP, so the operator can place models pod by pod instead of through a Service. Calls
carry the installation's control credential (the servers restrict the control APIs to it) and, for a pool with
TLS, use HTTPS verified against the pool's CA and its Service's DNS name.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import json
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from .naming import HTTP_PORT


class ControlError(Exception):
    """A model-control call did not succeed."""


class ServerUnreachable(ControlError):
    """No usable answer from the server (connection refused, timeout, or not KServe v2 JSON)."""


class ModelControlError(ControlError):
    """The server answered with an error for a load or unload: the message is the server's own."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: str
    reason: str = ""
    # Bytes the server measured the loaded model to hold (host + GPU, after warm-up); None: not measured yet
    memory_bytes: int | None = None

    @property
    def ready(self) -> bool:
        return self.state == "READY"


def _measured_bytes(entry: Mapping[str, Any]) -> int | None:
    """A READY entry's measured memory (host + GPU) from a Naiad server's index; None when declared or absent."""
    if entry.get("memory_source") != "measured":
        return None
    host, gpu = entry.get("host_memory_bytes"), entry.get("gpu_memory_bytes")
    if not isinstance(host, int) or not isinstance(gpu, int):
        return None
    return host + gpu


def base_url(host: str, port: int = HTTP_PORT, scheme: str = "http") -> str:
    """http://host:port (or https), bracketing IPv6 addresses."""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            host = f"[{host}]"
    except ValueError:
        pass  # a DNS name
    return f"{scheme}://{host}:{port}"


def _error_message(status: int, text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip() or f"HTTP {status}"
    if isinstance(body, Mapping) and body.get("error"):
        return str(body["error"])
    return text.strip() or f"HTTP {status}"


def _is_not_found(status: int, message: str) -> bool:
    lowered = message.lower()
    return status == 404 or "not found" in lowered or "unknown model" in lowered


class ModelControlClient:
    """One aiohttp session for all pods; per-call timeouts (loads may take minutes, index calls must not)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        port: int = HTTP_PORT,
        request_timeout: float = 10.0,
        load_timeout: float = 600.0,
        credentials: Callable[[], Sequence[str]] | None = None,
        credential_header: str = "naiad-control-key",
    ):
        self._session = session
        self._port = port
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._load_timeout = aiohttp.ClientTimeout(total=load_timeout)
        # Credentials to try in order: the current one, then the one before a rotation (pods not yet rolled).
        self._credentials = credentials or (lambda: ())
        self._credential_header = credential_header
        self._scheme = "http"
        self._ssl: ssl.SSLContext | None = None
        self._server_hostname: str | None = None

    def with_tls(self, context: ssl.SSLContext, server_hostname: str) -> ModelControlClient:
        """The same client for a pool that serves HTTPS: certificates verified with `context` against
        `server_hostname` (pods are called by IP, their certificate names the pool's Service)."""
        client = copy.copy(self)
        client._scheme, client._ssl, client._server_hostname = "https", context, server_hostname
        return client

    async def _call(
        self,
        method: str,
        host: str,
        path: str,
        *,
        body: Any = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> tuple[int, str]:
        url = base_url(host, self._port, self._scheme) + path
        kwargs: dict[str, Any] = {"timeout": timeout or self._timeout}
        headers = {}
        if body is not None:
            kwargs["data"] = json.dumps(body)
            headers["Content-Type"] = "application/json"
        if self._ssl is not None:
            kwargs["ssl"] = self._ssl
            kwargs["server_hostname"] = self._server_hostname
        status, text = 0, ""
        candidates: list[str | None] = [*self._credentials()] or [None]
        for credential in candidates:
            if credential is not None:
                headers[self._credential_header] = credential
            try:
                async with self._session.request(method, url, headers=headers, **kwargs) as response:
                    status, text = response.status, await response.text()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
                raise ServerUnreachable(
                    f"{method} {url}: {error.__class__.__name__}: {error}".rstrip(": ")
                ) from error
            if status != 403:  # 403: a pod still expecting the credential from before a rotation
                break
        return status, text

    async def live(self, host: str) -> bool:
        try:
            status, _ = await self._call("GET", host, "/v2/health/live")
        except ServerUnreachable:
            return False
        return status == 200

    async def ready(self, host: str) -> bool:
        try:
            status, _ = await self._call("GET", host, "/v2/health/ready")
        except ServerUnreachable:
            return False
        return status == 200

    async def index(self, host: str) -> list[IndexEntry]:
        """Every model the server knows, with state (READY, UNAVAILABLE, LOADING, ...)."""
        status, text = await self._call("POST", host, "/v2/repository/index", body={"memory": True})
        if status != 200:
            raise ServerUnreachable(
                f"repository index on {host} answered {status}: {_error_message(status, text)}"
            )
        try:
            entries = json.loads(text)
        except ValueError as error:
            raise ServerUnreachable(f"repository index on {host} is not JSON: {text[:200]!r}") from error
        if not isinstance(entries, list):
            raise ServerUnreachable(f"repository index on {host} is not a list: {text[:200]!r}")
        result = []
        for entry in entries:
            if isinstance(entry, Mapping) and entry.get("name"):
                result.append(
                    IndexEntry(
                        name=str(entry["name"]),
                        version=str(entry.get("version") or ""),
                        state=str(entry.get("state") or ""),
                        reason=str(entry.get("reason") or ""),
                        memory_bytes=_measured_bytes(entry),
                    )
                )
        return result

    async def load(self, host: str, model: str, config: Mapping[str, Any] | None = None) -> None:
        """Load (or reload, when already loaded) `model`; `config` is a ModelConfig override in JSON form."""
        body = {"parameters": {"config": json.dumps(config, sort_keys=True)}} if config is not None else None
        status, text = await self._call(
            "POST",
            host,
            f"/v2/repository/models/{quote(model, safe='')}/load",
            body=body,
            timeout=self._load_timeout,
        )
        if status != 200:
            raise ModelControlError(_error_message(status, text), status)

    async def unload(self, host: str, model: str) -> None:
        """Unload `model`; a server that does not know it has nothing to unload, which counts as done."""
        status, text = await self._call("POST", host, f"/v2/repository/models/{quote(model, safe='')}/unload")
        if status == 200:
            return
        message = _error_message(status, text)
        if _is_not_found(status, message):
            return
        raise ModelControlError(message, status)
