"""What the e2e cluster's local processes (Go controllers built by tools/go/build.sh and run beside the API server:
LeaderWorkerSet, KEDA) share: the last line a build script prints, a free local port, a wait for their CRDs, and a
CA with a serving certificate for 127.0.0.1."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import subprocess
import time
from pathlib import Path

from .cluster import ClusterError, KwokCluster


def tool_output(args: list[str], timeout: float) -> str:
    """The last line `args` print (a cache directory), or ClusterError with their stderr."""
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/local/go/bin"}
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        raise ClusterError(f"{' '.join(args)} failed: {result.stderr[-1500:]}")
    return result.stdout.strip().splitlines()[-1]


def wait_crd_established(cluster: KwokCluster, crd: str, timeout: float = 60) -> None:
    """Until the API server serves a CRD just applied (`crd`: its full name, e.g. scaledobjects.keda.sh)."""
    deadline = time.monotonic() + timeout
    while True:  # kubectl wait fails at once while a new CRD has no status yet
        result = cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s", check=False
        )
        if result.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"the CRD {crd} is not Established: {result.stderr}")
        time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_serving_certificate(cert_dir: Path) -> bytes:
    """A CA and, signed by it, a certificate for 127.0.0.1 (tls.crt / tls.key, where controller-runtime's webhook
    server looks); returns the CA certificate (PEM) for the webhooks' caBundle."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "naiad-e2e-lws-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_dir.mkdir(parents=True, exist_ok=True)
    (cert_dir / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (cert_dir / "tls.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return ca.public_bytes(serialization.Encoding.PEM)
