"""TLS on the HTTP, gRPC (both implementations) and metrics ports: tritonclient with ssl=True, mutual TLS,
an expired certificate, and a certificate reloaded when its files change."""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import ssl
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from helpers import NaiadProcess
from pki import Pki

ROOT = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tls-repo")
    shutil.copytree(ROOT / "models" / "add_sub", out / "add_sub")
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"), "naiad-test-ca")


def _tls_args(cert: str, key: str, *, root: str | None = None) -> list[str]:
    out = []
    for endpoint in ("grpc", "http", "metrics"):
        out += [f"--{endpoint}-server-cert", cert, f"--{endpoint}-server-key", key]
        if root:
            out += [f"--{endpoint}-use-ssl-mutual=true", f"--{endpoint}-root-cert", root]
        else:
            out += [f"--{endpoint}-use-ssl=true"]
    return out


def _inputs(module):
    a = module.InferInput("INPUT0", [4], "FP32")
    a.set_data_from_numpy(np.arange(4, dtype=np.float32))
    b = module.InferInput("INPUT1", [4], "FP32")
    b.set_data_from_numpy(np.ones(4, dtype=np.float32))
    return [a, b]


def _grpc_infer(proc: NaiadProcess, ca: str, client: tuple[str, str] | None = None):
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(
        f"localhost:{proc.grpc_port}",
        ssl=True,
        root_certificates=ca,
        certificate_chain=client[0] if client else None,
        private_key=client[1] if client else None,
    )
    try:
        return c.infer("add_sub", _inputs(grpcclient)).as_numpy("OUTPUT0")
    finally:
        c.close()


def _http_infer(proc: NaiadProcess, ca: str, client: tuple[str, str] | None = None):
    import tritonclient.http as httpclient

    options = {"ca_certs": ca}
    if client:
        options.update(certfile=client[0], keyfile=client[1])
    c = httpclient.InferenceServerClient(
        f"localhost:{proc.http_port}", ssl=True, ssl_options=options, connection_timeout=5, network_timeout=5
    )
    try:
        return c.infer("add_sub", _inputs(httpclient)).as_numpy("OUTPUT0")
    finally:
        c.close()


EXPECTED = np.arange(4, dtype=np.float32) + 1


@pytest.mark.parametrize("implementation", ["naiad", "grpcio"])
def test_tls_on_every_port(repo, pki, implementation):
    cert, key = pki.issue("server")
    with NaiadProcess(repo, "--grpc-implementation", implementation, *_tls_args(cert, key)) as proc:
        np.testing.assert_array_equal(_grpc_infer(proc, pki.ca), EXPECTED)
        np.testing.assert_array_equal(_http_infer(proc, pki.ca), EXPECTED)
        r = requests.get(f"https://localhost:{proc.metrics_port}/metrics", verify=pki.ca, timeout=5)
        assert r.status_code == 200 and "nv_inference_request_success" in r.text
        # both HTTP paths: the fast path answered infer above; aiohttp answers the rest over the same TLS
        r = requests.get(f"https://localhost:{proc.http_port}/v2/models/add_sub/config", verify=pki.ca)
        assert r.status_code == 200 and r.json()["name"] == "add_sub"
        # cleartext on a TLS port gets no answer
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://localhost:{proc.http_port}/v2/health/live", timeout=5)
        if implementation == "naiad":
            assert _alpn(proc.grpc_port, pki.ca, ["h2"]) == "h2"


def _alpn(port: int, ca: str, protocols: list[str]) -> str | None:
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols(protocols)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            return tls.selected_alpn_protocol()


@pytest.mark.parametrize("implementation", ["naiad", "grpcio"])
def test_mutual_tls_requires_a_client_certificate_from_the_root(repo, pki, tmp_path, implementation):
    from tritonclient.utils import InferenceServerException

    cert, key = pki.issue("server")
    client = pki.issue("client", server=False)
    stranger = Pki(tmp_path / "other", "other-ca").issue("stranger", server=False)
    args = ("--grpc-implementation", implementation, *_tls_args(cert, key, root=pki.ca))
    with NaiadProcess(repo, *args, client_cert=client) as proc:
        np.testing.assert_array_equal(_grpc_infer(proc, pki.ca, client), EXPECTED)
        np.testing.assert_array_equal(_http_infer(proc, pki.ca, client), EXPECTED)
        for who in (None, stranger):
            with pytest.raises(InferenceServerException):
                _grpc_infer(proc, pki.ca, who)
            # TLS 1.3: the server refuses the client's certificate after the client's side of the handshake,
            # so the client sees an alert or the connection closed when it reads the answer
            with pytest.raises((ssl.SSLError, OSError, http.client.HTTPException)):
                _http_infer(proc, pki.ca, who)
            with pytest.raises(requests.ConnectionError):  # SSLError, or closed without an answer (TLS 1.3)
                requests.get(f"https://localhost:{proc.metrics_port}/metrics", verify=pki.ca, cert=who)
        # the refusals did not harm the server: the client with its certificate still gets answers
        r = requests.get(f"https://localhost:{proc.metrics_port}/metrics", verify=pki.ca, cert=client)
        assert r.status_code == 200
        np.testing.assert_array_equal(_grpc_infer(proc, pki.ca, client), EXPECTED)
        np.testing.assert_array_equal(_http_infer(proc, pki.ca, client), EXPECTED)


@pytest.mark.parametrize("implementation", ["naiad", "grpcio"])
def test_expired_certificate_is_refused_by_a_verifying_client(repo, pki, implementation):
    from tritonclient.utils import InferenceServerException

    cert, key = pki.issue("expired", expired=True)
    with NaiadProcess(repo, "--grpc-implementation", implementation, *_tls_args(cert, key)) as proc:
        with pytest.raises(InferenceServerException):
            _grpc_infer(proc, pki.ca)
        with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
            _http_infer(proc, pki.ca)
        with pytest.raises(requests.exceptions.SSLError, match="expired"):
            requests.get(f"https://localhost:{proc.metrics_port}/metrics", verify=pki.ca)


def _served_certificate(port: int, alpn: list[str]) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(alpn)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            return tls.getpeercert(binary_form=True)


def _der(path: str) -> bytes:
    return x509.load_pem_x509_certificate(Path(path).read_bytes()).public_bytes(serialization.Encoding.DER)


def _replace(src: str, dst: Path) -> None:
    """Atomically, as the kubelet updates a mounted Secret."""
    tmp = dst.with_suffix(".new")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


@pytest.mark.parametrize("implementation", ["naiad", "grpcio"])
def test_certificate_reloaded_when_its_files_change(repo, pki, tmp_path, implementation):
    other = Pki(tmp_path / "next", "next-ca")
    first = pki.issue("first")
    second = other.issue("second")
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    cert, key = mounted / "tls.crt", mounted / "tls.key"
    shutil.copyfile(first[0], cert)
    shutil.copyfile(first[1], key)
    args = ("--grpc-implementation", implementation, *_tls_args(str(cert), str(key)))
    with NaiadProcess(repo, *args) as proc:
        ports = {proc.grpc_port: ["h2"], proc.http_port: ["http/1.1"], proc.metrics_port: ["http/1.1"]}
        for port, alpn in ports.items():
            assert _served_certificate(port, alpn) == _der(first[0])
        np.testing.assert_array_equal(_grpc_infer(proc, pki.ca), EXPECTED)
        # a key that does not match the certificate (half a rotation) is not taken: the old pair stays in use
        _replace(second[0], cert)
        time.sleep(3)
        for port, alpn in ports.items():
            assert _served_certificate(port, alpn) == _der(first[0])
        _replace(second[1], key)
        deadline = time.monotonic() + 20
        pending = dict(ports)
        while pending and time.monotonic() < deadline:
            for port, alpn in list(pending.items()):
                if _served_certificate(port, alpn) == _der(second[0]):
                    del pending[port]
            time.sleep(0.2)
        assert not pending, f"ports still serving the old certificate: {sorted(pending)}"
        # real clients that trust only the new CA now connect, without a restart
        np.testing.assert_array_equal(_grpc_infer(proc, other.ca), EXPECTED)
        np.testing.assert_array_equal(_http_infer(proc, other.ca), EXPECTED)
        assert proc.proc.poll() is None
        assert "certificate reloaded" in proc.output()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grpc-use-ssl"], "--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key"),
        (
            ["--http-use-ssl-mutual=true", "--http-server-cert", "{cert}", "--http-server-key", "{key}"],
            "needs --http-root-cert",
        ),
        (
            ["--http-use-ssl", "--http-server-cert", "/nonexistent.crt", "--http-server-key", "{key}"],
            "does not exist",
        ),
        (
            ["--grpc-use-ssl", "--grpc-server-cert", "{cert}", "--grpc-server-key", "{other_key}"],
            "cannot use",
        ),
        (["--grpc-use-ssl=maybe"], "expected true or false"),
    ],
)
def test_incomplete_or_broken_tls_settings_stop_the_server_with_a_clear_error(repo, pki, args, message):
    import subprocess
    import sys

    cert, key = pki.issue("server")
    _, other_key = pki.issue("other")
    argv = [a.format(cert=cert, key=key, other_key=other_key) for a in args]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "naiad.cli",
            "serve",
            "--model-repository",
            str(repo),
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--metrics-port",
            "0",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT.parent / "server")},
    )
    assert done.returncode != 0
    assert message in done.stderr, done.stderr[-2000:]


def test_https_on_the_aiohttp_only_path(repo, pki, monkeypatch):
    """NAIAD_HTTP_FAST=0 serves every HTTP request with aiohttp: the same certificate and reload apply there."""
    monkeypatch.setenv("NAIAD_HTTP_FAST", "0")
    cert, key = pki.issue("server")
    with NaiadProcess(repo, *_tls_args(cert, key)) as proc:
        np.testing.assert_array_equal(_http_infer(proc, pki.ca), EXPECTED)
        assert _served_certificate(proc.http_port, ["http/1.1"]) == _der(cert)
