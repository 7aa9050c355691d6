"""TLS for Naiad's endpoints: Triton's `--grpc-use-ssl` flags (and the same for HTTP and metrics), the server's
SSL contexts and grpcio credentials, and certificates reloaded from their files when they change."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from ...flags import parse_bool as _bool

log = logging.getLogger("naiad.tls")

# How often certificate files are looked at (a stat of each; cert-manager and the kubelet swap them atomically).
RELOAD_INTERVAL_S = 2.0

ENDPOINTS = {
    "grpc": "gRPC",
    "http": "HTTP",
    "metrics": "metrics",
}


def add_arguments(parser: argparse.ArgumentParser, endpoint: str) -> None:
    """`--<endpoint>-use-ssl`, `-use-ssl-mutual`, `-server-cert`, `-server-key`, `-root-cert`, as tritonserver
    spells them for gRPC. The booleans take a value (`--grpc-use-ssl=true`) or none (`--grpc-use-ssl`)."""
    what = ENDPOINTS[endpoint]
    p = f"--{endpoint}"
    parser.add_argument(
        f"{p}-use-ssl", type=_bool, nargs="?", const=True, default=False, help=f"serve {what} over TLS"
    )
    parser.add_argument(
        f"{p}-use-ssl-mutual",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help=f"serve {what} over TLS and require a client certificate signed by {p}-root-cert",
    )
    parser.add_argument(f"{p}-server-cert", default=None, help=f"PEM certificate (chain) of the {what} port")
    parser.add_argument(f"{p}-server-key", default=None, help=f"PEM private key of the {what} port")
    parser.add_argument(
        f"{p}-root-cert",
        default=None,
        help="PEM CA certificate(s) client certificates must chain to (mutual)",
    )


@dataclass(frozen=True)
class TlsSettings:
    """Where one endpoint's certificate, key and (for mutual TLS) client CA are."""

    cert: str
    key: str
    root: str | None = None
    mutual: bool = False


def settings_from_args(
    args: argparse.Namespace, endpoint: str, fallback: TlsSettings | None = None
) -> TlsSettings | None:
    """The endpoint's TLS settings, or None for cleartext. A missing cert or key falls back to `fallback`'s
    (the metrics port reuses the HTTP port's certificate). Raises ValueError for an incomplete setting."""
    name = endpoint.replace("-", "_")
    mutual = bool(getattr(args, f"{name}_use_ssl_mutual"))
    if not (getattr(args, f"{name}_use_ssl") or mutual):
        return None
    cert = getattr(args, f"{name}_server_cert") or (fallback.cert if fallback else None)
    key = getattr(args, f"{name}_server_key") or (fallback.key if fallback else None)
    root = getattr(args, f"{name}_root_cert") or (fallback.root if fallback else None)
    if not cert or not key:
        raise ValueError(f"--{endpoint}-use-ssl needs --{endpoint}-server-cert and --{endpoint}-server-key")
    if mutual and not root:
        raise ValueError(f"--{endpoint}-use-ssl-mutual needs --{endpoint}-root-cert")
    for path in (cert, key, root):
        if path and not os.path.isfile(path):
            raise ValueError(f"--{endpoint}: certificate file '{path}' does not exist")
    return TlsSettings(cert, key, root if mutual else None, mutual)


def _signature(settings: TlsSettings) -> tuple:
    """What changes when a file is rewritten or a mounted Secret's symlinks are swapped."""
    out: list[tuple[int, int, int, int] | None] = []
    for path in (settings.cert, settings.key, settings.root):
        if path is None:
            continue
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns))
    return tuple(out)


@dataclass(frozen=True)
class Material:
    """One consistent read of the PEM files."""

    cert: bytes
    key: bytes
    root: bytes | None


def read_material(settings: TlsSettings) -> Material:
    with open(settings.cert, "rb") as f:
        cert = f.read()
    with open(settings.key, "rb") as f:
        key = f.read()
    root = None
    if settings.root:
        with open(settings.root, "rb") as f:
            root = f.read()
    return Material(cert, key, root)


def _new_context(mutual: bool, alpn: list[str] | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if alpn:
        ctx.set_alpn_protocols(alpn)
    if mutual:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _load(ctx: ssl.SSLContext, material: Material) -> None:
    """Loads `material` into `ctx`, through private temporary files (the ssl module reads keys from files)."""
    with tempfile.TemporaryDirectory(prefix="naiad-tls-") as tmp:  # mode 0700
        cert = os.path.join(tmp, "tls.crt")
        key = os.path.join(tmp, "tls.key")
        for path, data in ((cert, material.cert), (key, material.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)
    if material.root is not None:
        ctx.load_verify_locations(cadata=material.root.decode("ascii", "replace"))


def check_material(material: Material, mutual: bool) -> None:
    """Raises ssl.SSLError / ValueError when the files do not make a usable certificate (e.g. a key that does not
    belong to the certificate, as seen for a moment while a rotation writes the files)."""
    _load(_new_context(mutual, None), material)


class ReloadingContext:
    """An ssl.SSLContext for an asyncio server whose certificate follows its files: on a change the new files are
    checked on a scratch context, then loaded into this one, which new handshakes use (open connections keep
    theirs). A CA added to the root file is trusted at once; one removed stays trusted until a restart."""

    def __init__(self, settings: TlsSettings, alpn: list[str] | None, name: str):
        self.settings = settings
        self.name = name
        self._signature = _signature(settings)
        material = read_material(settings)
        self.context = _new_context(settings.mutual, alpn)
        try:
            check_material(material, settings.mutual)
            _load(self.context, material)
        except (ssl.SSLError, ValueError) as exc:
            raise ValueError(f"{name} TLS: cannot use {settings.cert} / {settings.key}: {exc}") from exc
        self._task: asyncio.Task | None = None
        self.reloads = 0

    def check(self) -> bool:
        """Reloads when the files changed; True when the new certificate is now in use."""
        signature = _signature(self.settings)
        if signature == self._signature:
            return False
        try:
            material = read_material(self.settings)
            check_material(material, self.settings.mutual)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning(
                "%s TLS: certificate files changed but cannot be used yet (%s); retrying", self.name, exc
            )
            return False
        _load(self.context, material)
        self._signature = signature
        self.reloads += 1
        log.info("%s TLS: certificate reloaded from %s", self.name, self.settings.cert)
        return True

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_INTERVAL_S)
            try:
                self.check()
            except Exception:  # never let a bad file stop the watcher
                log.exception("%s TLS: reloading the certificate failed", self.name)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def grpcio_credentials(settings: TlsSettings, clock: Callable[[], float] | None = None):
    """grpc.aio server credentials whose certificate follows its files: grpc asks the fetcher at each new
    handshake; it looks at the files at most every RELOAD_INTERVAL_S and answers None (no change) or the new
    configuration once the new files make a usable certificate."""
    import time

    import grpc

    clock = clock or time.monotonic

    def configuration(material: Material):
        return grpc.ssl_server_certificate_configuration(
            [(material.key, material.cert)], root_certificates=material.root
        )

    material = read_material(settings)
    try:
        check_material(material, settings.mutual)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(f"gRPC TLS: cannot use {settings.cert} / {settings.key}: {exc}") from exc
    state = {"signature": _signature(settings), "checked": clock()}

    def fetch():
        now = clock()
        if now - state["checked"] < RELOAD_INTERVAL_S:
            return None
        state["checked"] = now
        signature = _signature(settings)
        if signature == state["signature"]:
            return None
        try:
            fresh = read_material(settings)
            check_material(fresh, settings.mutual)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("gRPC TLS: certificate files changed but cannot be used yet (%s); retrying", exc)
            return None
        state["signature"] = signature
        log.info("gRPC TLS: certificate reloaded from %s", settings.cert)
        return configuration(fresh)

    return grpc.dynamic_ssl_server_credentials(
        configuration(material), fetch, require_client_authentication=settings.mutual
    )


def describe(settings: TlsSettings | None) -> str:
    if settings is None:
        return ""
    return " (TLS, client certificate required)" if settings.mutual else " (TLS)"
