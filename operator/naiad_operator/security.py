"""The control credential (one per installation, rotated on demand) and a pool's TLS: how server pods are started
with them, and how the operator's own model-control calls authenticate and verify the servers."""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .kube import KubeClient, KubeError
from .naming import FIELD_MANAGER, GROUP, short_hash

log = logging.getLogger(__name__)

# Header (HTTP) / metadata key (gRPC) the control API groups need; the server compares it in constant time.
CONTROL_HEADER = "naiad-control-key"
# API groups only the operator (or whoever holds the credential) may call; inference, health, metadata,
# model configuration and statistics stay open.
CONTROL_GROUPS = ("model-repository", "shared-memory", "logging", "trace")
# The server pod reads the credential from this variable (`env:` in the restricted-API flag), never from its args.
CONTROL_ENV = "NAIAD_CONTROL_CREDENTIAL"
CREDENTIAL_KEY = "credential"
PREVIOUS_KEY = "previous"
# The installation's Secret, in the operator's namespace; annotate it with ROTATE_ANNOTATION to rotate.
INSTALLATION_SECRET = "naiad-control-credential"
ROTATE_ANNOTATION = f"{GROUP}/rotate"
# Pod-template annotation: a hash of the credential, so that a rotation rolls the pods onto the new one.
CREDENTIAL_HASH_ANNOTATION = f"{GROUP}/control-credential-hash"

TLS_MOUNT = "/etc/naiad/tls"
TLS_VOLUME = "tls"


def control_secret_name(server: str) -> str:
    """The pool's copy of the credential, in the pool's namespace (a pod can only read Secrets there)."""
    return f"{server}-control"


def restriction_args() -> list[str]:
    rule = f"{','.join(CONTROL_GROUPS)}:{CONTROL_HEADER}=env:{CONTROL_ENV}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


def control_env(server: str) -> dict[str, Any]:
    return {
        "name": CONTROL_ENV,
        "valueFrom": {"secretKeyRef": {"name": control_secret_name(server), "key": CREDENTIAL_KEY}},
    }


def credential_hash(credential: str) -> str:
    return short_hash(credential, 16)


def tls_secret_name(spec: Mapping[str, Any]) -> str | None:
    return ((spec.get("tls") or {}).get("secretName")) or None


def tls_args() -> list[str]:
    """TLS on the HTTP, gRPC and metrics ports from a kubernetes.io/tls Secret mounted at TLS_MOUNT."""
    out = []
    for endpoint in ("http", "grpc", "metrics"):
        out += [
            f"--{endpoint}-use-ssl=true",
            f"--{endpoint}-server-cert={TLS_MOUNT}/tls.crt",
            f"--{endpoint}-server-key={TLS_MOUNT}/tls.key",
        ]
    return out


def server_hostname(server: str, namespace: str) -> str:
    """The name the operator (and Prometheus) verify a pool's certificate against: its Service's DNS name."""
    return f"{server}.{namespace}.svc"


# --- the installation's credential --------------------------------------------------------------------------


def new_credential() -> str:
    return secrets.token_urlsafe(32)


def _decode(data: Mapping[str, str] | None, key: str) -> str | None:
    raw = (data or {}).get(key)
    if not raw:
        return None
    return base64.b64decode(raw).decode()


def _encode(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


@dataclass(frozen=True)
class Credentials:
    current: str
    previous: str | None = None

    def to_try(self) -> list[str]:
        return [self.current] + ([self.previous] if self.previous and self.previous != self.current else [])


class CredentialStore:
    """The installation's credential, read from (or first written to) its Secret by `refresh()`; a Secret
    annotated with ROTATE_ANNOTATION gets a new credential (the old one is kept as `previous`, which pods not yet
    rolled still expect)."""

    def __init__(self, kube: KubeClient, namespace: str):
        self.kube = kube
        self.namespace = namespace
        self.credentials: Credentials | None = None
        self._lock = asyncio.Lock()

    def to_try(self) -> list[str]:
        return self.credentials.to_try() if self.credentials else []

    async def refresh(self) -> Credentials:
        async with self._lock:
            self.credentials = await self._read_or_create()
            return self.credentials

    async def _read_or_create(self) -> Credentials:
        secret = await self.kube.get("v1", "Secret", self.namespace, INSTALLATION_SECRET)
        if secret is None:
            credentials = Credentials(new_credential())
            await self._write(credentials, create=True)
            log.info("created the control credential Secret %s/%s", self.namespace, INSTALLATION_SECRET)
            return credentials
        current = _decode(secret.get("data"), CREDENTIAL_KEY)
        previous = _decode(secret.get("data"), PREVIOUS_KEY)
        annotations = (secret.get("metadata") or {}).get("annotations") or {}
        if current and ROTATE_ANNOTATION not in annotations:
            return Credentials(current, previous)
        credentials = Credentials(new_credential(), current)
        await self._write(credentials, create=False)
        log.info("rotated the control credential in Secret %s/%s", self.namespace, INSTALLATION_SECRET)
        return credentials

    async def _write(self, credentials: Credentials, create: bool) -> None:
        data = {CREDENTIAL_KEY: _encode(credentials.current)}
        if credentials.previous:
            data[PREVIOUS_KEY] = _encode(credentials.previous)
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": INSTALLATION_SECRET,
                "namespace": self.namespace,
                "labels": {"app.kubernetes.io/managed-by": FIELD_MANAGER},
            },
            "type": "Opaque",
            "data": data,
        }
        if create:
            await self.kube.apply(body)
        else:
            patch = {"metadata": {"annotations": {ROTATE_ANNOTATION: None}}, "data": data}
            await self.kube.patch("v1", "Secret", self.namespace, INSTALLATION_SECRET, patch)


# --- verifying a pool's certificate ---------------------------------------------------------------------------


class TrustCache:
    """One ssl.SSLContext per TLS Secret version: the CA from the Secret's ca.crt (the system's CAs without it)."""

    def __init__(self, kube: KubeClient):
        self.kube = kube
        self._contexts: dict[tuple[str, str], tuple[str, ssl.SSLContext]] = {}

    async def context(self, namespace: str, secret_name: str) -> ssl.SSLContext:
        try:
            secret = await self.kube.get("v1", "Secret", namespace, secret_name)
        except KubeError as error:
            log.warning(
                "TLS Secret %s/%s unreadable (%s): verifying with system CAs", namespace, secret_name, error
            )
            secret = None
        version = str(((secret or {}).get("metadata") or {}).get("resourceVersion") or "")
        cached = self._contexts.get((namespace, secret_name))
        if cached is not None and cached[0] == version and secret is not None:
            return cached[1]
        ca = _decode((secret or {}).get("data"), "ca.crt")
        context = ssl.create_default_context(cadata=ca) if ca else ssl.create_default_context()
        if secret is not None:
            self._contexts[(namespace, secret_name)] = (version, context)
        return context
