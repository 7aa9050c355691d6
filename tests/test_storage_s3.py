"""Models from s3:// repositories, served from a real MinIO: every control mode, credentials, changes in the
bucket, partial uploads, a 500 MB model file, and https:// archives."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import re
import resource
import shutil
import ssl
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from helpers import NaiadProcess
from tritonclient.utils import InferenceServerException

CONFIG = """name: "{name}"
backend: "python"
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
version_policy: {{ all {{ }} }}
"""

MODEL_PY = """import os
import numpy as np
import triton_python_backend_utils as pb_utils

FACTOR = {factor}
WEIGHTS_BYTES = {weights}


class TritonPythonModel:
    def initialize(self, args):
        if WEIGHTS_BYTES:
            path = os.path.join(os.path.dirname(__file__), "weights.bin")
            size = os.path.getsize(path)
            if size != WEIGHTS_BYTES:
                raise ValueError(f"weights.bin holds {{size}} bytes, expected {{WEIGHTS_BYTES}}")

    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", (x * FACTOR).astype(np.float32))]))
        return out
"""


def put_model(
    client, bucket, prefix, name, versions=(1,), factor=2.0, config=True, model_file=True, weights=0
):
    """Upload a `scale` model: OUTPUT0 = INPUT0 * factor (per version: factor + version - 1)."""
    if config:
        client.put_object(
            Bucket=bucket, Key=f"{prefix}/{name}/config.pbtxt", Body=CONFIG.format(name=name).encode()
        )
    for v in versions:
        if model_file:
            body = MODEL_PY.format(factor=factor + v - 1, weights=weights).encode()
            client.put_object(Bucket=bucket, Key=f"{prefix}/{name}/{v}/model.py", Body=body)


def write_model(folder: Path, name: str, factor: float = 2.0) -> Path:
    (folder / name / "1").mkdir(parents=True, exist_ok=True)
    (folder / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (folder / name / "1" / "model.py").write_text(MODEL_PY.format(factor=factor, weights=0))
    return folder


def infer(server, name, version=""):
    client = httpclient.InferenceServerClient(server.http)
    try:
        x = np.arange(4, dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", [4], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(name, [inp], model_version=version).as_numpy("OUTPUT0")
        return float(result[1])  # x[1] == 1: the factor
    finally:
        client.close()


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def ready(server, name, version=""):
    url = f"{server.url}/v2/models/{name}" + (f"/versions/{version}" if version else "") + "/ready"
    return requests.get(url, timeout=5).status_code == 200


def index(server):
    return requests.post(f"{server.url}/v2/repository/index", json={}, timeout=30).json()


def no_ambient_aws(**extra):
    """An environment where the SDK finds only what the test gives it (never the instance metadata service)."""
    env = {k: None for k in os.environ if k.startswith("AWS_")}
    env.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE="/nonexistent/naiad-aws-config",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent/naiad-aws-credentials",
    )
    env.update(extra)
    return env


@pytest.fixture
def serve(minio, tmp_path):
    started = []

    def start(repos, *args, env=None, wait_ready=True):
        full_env = no_ambient_aws(**(minio.env() if env is None else env))
        proc = NaiadProcess(
            repos,
            "--storage-cache-dir",
            str(tmp_path / "cache"),
            *args,
            env=full_env,
            wait_ready=wait_ready,
            timeout=120,
        )
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.stop()


def test_uri_syntax():
    from naiad.storage import StorageError
    from naiad.storage.s3 import parse_uri

    assert parse_uri("s3://bucket/path/to/repo") == (None, "bucket", "path/to/repo")
    assert parse_uri("s3://bucket") == (None, "bucket", "")
    assert parse_uri("s3://minio.local:9000/bucket/repo/") == ("http://minio.local:9000", "bucket", "repo")
    assert parse_uri("s3://https://10.0.0.1:443/b/r") == ("https://10.0.0.1:443", "b", "r")
    assert parse_uri("s3://http://host:80/b") == ("http://host:80", "b", "")
    with pytest.raises(StorageError, match="not an S3 URI"):
        parse_uri("s3://")


def test_none_mode_mixed_with_local(serve, minio, bucket, tmp_path):
    name, client = bucket
    put_model(client, name, "models", "scale_s3", versions=(1, 2))
    local = write_model(tmp_path / "local", "scale_local", factor=5.0)
    server = serve([f"s3://{minio.host}/{name}/models", str(local)])
    assert infer(server, "scale_s3") == 3.0  # latest of versions 1, 2 (version_policy all)
    assert infer(server, "scale_s3", "1") == 2.0
    assert infer(server, "scale_local") == 5.0
    names = {e["name"] for e in index(server)}
    assert names == {"scale_s3", "scale_local"}
    # the copy lives in the cache directory, complete
    copies = list((tmp_path / "cache").glob("s3-*/scale_s3/*/scale_s3/2/model.py"))
    assert len(copies) == 1
    assert not list((tmp_path / "cache").glob("s3-*/scale_s3/.tmp-*"))


def test_poll_mode_new_changed_removed(serve, minio, bucket):
    name, client = bucket
    put_model(client, name, "repo", "first")
    server = serve(
        [f"s3://http://{minio.host}/{name}/repo"],
        "--model-control-mode",
        "poll",
        "--repository-poll-secs",
        "0.5",
    )
    assert infer(server, "first") == 2.0
    # a new model
    put_model(client, name, "repo", "second", factor=7.0)
    wait_for(lambda: ready(server, "second"), what="the new model to load")
    assert infer(server, "second") == 7.0
    # a new version
    put_model(client, name, "repo", "first", versions=(2,), factor=2.0)
    wait_for(lambda: ready(server, "first", "2"), what="version 2 to load")
    assert infer(server, "first") == 3.0
    # a model file replaced in the bucket
    put_model(client, name, "repo", "first", versions=(2,), factor=10.0, config=False)
    wait_for(lambda: infer(server, "first") == 11.0, what="the replaced model file to be served")
    # a removed model
    for key in ("second/config.pbtxt", "second/1/model.py"):
        client.delete_object(Bucket=name, Key=f"repo/{key}")
    wait_for(lambda: not ready(server, "second"), what="the removed model to unload")
    assert infer(server, "first") == 11.0
    assert "1 object(s) fetched, 2 unchanged (ETag) reused" in server.output()


def test_explicit_mode_fetches_at_load(serve, minio, bucket):
    name, client = bucket
    server = serve([f"s3://{minio.host}/{name}/repo"], "--model-control-mode", "explicit")
    put_model(client, name, "repo", "late", factor=4.0)  # uploaded after the server started
    assert {e["name"] for e in index(server)} == {"late"}
    control = httpclient.InferenceServerClient(server.http)
    control.load_model("late")
    assert infer(server, "late") == 4.0
    put_model(client, name, "repo", "late", factor=6.0, config=False)
    assert infer(server, "late") == 4.0  # explicit: nothing changes until the next load
    control.load_model("late")
    assert infer(server, "late") == 6.0
    with pytest.raises(InferenceServerException, match="failed to poll from model repository"):
        control.load_model("missing")
    control.close()


def test_partial_upload_is_never_loaded(serve, minio, bucket):
    name, client = bucket
    put_model(client, name, "repo", "good", factor=3.0)
    put_model(client, name, "repo", "half", model_file=False)  # config.pbtxt, no version folder yet
    server = serve(
        [f"s3://{minio.host}/{name}/repo"],
        "--model-control-mode",
        "poll",
        "--repository-poll-secs",
        "0.5",
        "--strict-readiness",
        "false",
    )
    assert infer(server, "good") == 3.0
    entry = next(e for e in index(server) if e["name"] == "half")
    assert entry["state"] == "UNAVAILABLE" and "at least one version must be available" in entry["reason"]
    put_model(client, name, "repo", "half", config=False, factor=9.0)  # the upload completes
    wait_for(lambda: ready(server, "half"), what="the completed model to load")
    assert infer(server, "half") == 9.0
    # a broken replacement keeps the version that is serving
    client.put_object(Bucket=name, Key="repo/good/config.pbtxt", Body=b"name: 'good' backend: [broken")
    wait_for(lambda: "failed to load 'good'" in server.output(), what="the broken reload to fail")
    assert infer(server, "good") == 3.0


def test_credentials_wrong_missing_and_bad_bucket(serve, minio, bucket, tmp_path):
    name, client = bucket
    put_model(client, name, "repo", "guarded")
    local = write_model(tmp_path / "local", "other", factor=5.0)
    uri = f"s3://{minio.host}/{name}/repo"
    cases = [
        (minio.env(AWS_SECRET_ACCESS_KEY="wrong-secret-key"), uri, "access denied"),
        ({}, uri, "no credentials"),
        (minio.env(), f"s3://{minio.host}/no-such-bucket-here/repo", "no such bucket"),
        (minio.env(), f"s3://127.0.0.1:1/{name}/repo", "cannot reach the S3 endpoint"),
    ]
    for env, repo_uri, cause in cases:
        server = serve(
            [repo_uri, str(local)],
            "--model-control-mode",
            "explicit",
            "--load-model",
            "*",
            env=env,
            wait_ready=False,
        )
        wait_for(lambda s=server: ready(s, "other"), what="the local model")
        assert infer(server, "other") == 5.0  # the local model is untouched
        control = httpclient.InferenceServerClient(server.http)
        with pytest.raises(InferenceServerException) as err:
            control.load_model("guarded")
        assert cause in str(err.value) and repo_uri in str(err.value), str(err.value)
        assert infer(server, "other") == 5.0
        control.close()
        # strict readiness: a repository that cannot be listed keeps the server not ready
        assert requests.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 400
        server.stop()
        assert minio.secret_key not in server.output()


def test_large_model_streams_with_bounded_memory(serve, minio, bucket, tmp_path):
    """A 500 MB model file: fetched in parallel parts straight to disk; the server's peak RSS stays far below it."""
    name, client = bucket
    size = 500 * 2**20
    weights = tmp_path / "weights.bin"
    with open(weights, "wb") as f:  # sparse: written in no time, read back as zeros
        f.truncate(size)
    try:
        from boto3.s3.transfer import TransferConfig

        client.upload_file(
            str(weights),
            name,
            "repo/big/1/weights.bin",
            Config=TransferConfig(multipart_chunksize=64 * 2**20),
        )
    finally:
        weights.unlink()
    put_model(client, name, "repo", "big", factor=2.0, weights=size)
    server = serve([f"s3://{minio.host}/{name}/repo"], "--model-control-mode", "explicit")
    baseline = _peak_rss_kib(server.proc.pid)
    control = httpclient.InferenceServerClient(server.http, network_timeout=600)
    started = time.monotonic()
    control.load_model("big")
    seconds = time.monotonic() - started
    control.close()
    assert infer(server, "big") == 2.0
    peak = _peak_rss_kib(server.proc.pid)
    print(
        f"\n500 MiB model: load {seconds:.1f}s, server peak RSS {peak / 1024:.0f} MiB (before {baseline / 1024:.0f})"
    )
    assert peak - baseline < 200 * 1024, (baseline, peak)
    assert re.search(r"fetched s3://\S+/big: 500\.0 of 500\.0 MiB \(\d+\.\d MiB/s\)", server.output())
    copies = list((tmp_path / "cache").glob("s3-*/big/*/big/1/weights.bin"))
    assert copies and copies[0].stat().st_size == size
    server.stop()
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
    for part in ("repo/big/1/weights.bin",):
        client.delete_object(Bucket=name, Key=part)


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss


# --- https:// archives -------------------------------------------------------------------------------------------


@pytest.fixture
def https_files(tmp_path):
    """A real HTTPS server on 127.0.0.1 serving `root`, with a self-signed certificate; (root, base URL, CA)."""
    root = tmp_path / "www"
    root.mkdir()
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield root, f"https://127.0.0.1:{httpd.server_address[1]}", cert
    httpd.shutdown()


def _tar(path: Path, members: dict[str, bytes]) -> bytes:
    with tarfile.open(path, "w:gz") as tf:
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path.read_bytes()


def test_https_archive(serve, https_files, tmp_path):
    root, base, ca = https_files
    members = {
        "packed/config.pbtxt": CONFIG.format(name="packed").encode(),
        "packed/1/model.py": MODEL_PY.format(factor=8.0, weights=0).encode(),
    }
    digest = hashlib.sha256(_tar(root / "packed.tar.gz", members)).hexdigest()
    _tar(root / "evil.tar.gz", {"../../escaped.txt": b"x", "config.pbtxt": b'name: "evil"'})
    env = {"SSL_CERT_FILE": str(ca)}
    server = serve(
        [
            f"{base}/packed.tar.gz#sha256={digest}",
            f"{base}/evil.tar.gz",
            f"{base}/tampered.tar.gz#sha256={'0' * 64}",
        ],
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        "--strict-readiness",
        "false",
        env=env,
    )
    assert infer(server, "packed") == 8.0
    assert not list(tmp_path.rglob("escaped.txt"))
    out = server.output()
    assert re.search(r"cannot list model repository https://\S+/tampered\.tar\.gz: HTTP 404", out)
    evil = next(e for e in index(server) if e["name"] == "evil")
    assert "archive member '../../escaped.txt' escapes the model folder" in evil["reason"]
    # a wrong checksum refuses the archive
    shutil.copy(root / "packed.tar.gz", root / "tampered.tar.gz")
    control = httpclient.InferenceServerClient(server.http)
    with pytest.raises(
        InferenceServerException, match=r"tampered\.tar\.gz: sha256 is [0-9a-f]{64}, expected 0+"
    ):
        control.load_model("tampered")
    control.close()


def test_archives_that_escape_are_refused(tmp_path):
    import zipfile

    from naiad.storage import StorageError
    from naiad.storage.archive import extract

    cases = {}
    with zipfile.ZipFile(tmp_path / "up.zip", "w") as zf:
        zf.writestr("model/config.pbtxt", "")
        zf.writestr("../outside.txt", "x")
    cases["up.zip"] = "'../outside.txt' escapes the model folder"
    with zipfile.ZipFile(tmp_path / "abs.zip", "w") as zf:
        zf.writestr("/etc/naiad-test", "x")
    cases["abs.zip"] = "'/etc/naiad-test' escapes the model folder"
    with tarfile.open(tmp_path / "link.tar", "w") as tf:
        info = tarfile.TarInfo("model/1/model.py")
        info.type, info.linkname = tarfile.SYMTYPE, "../../../../etc/passwd"
        tf.addfile(info)
    cases["link.tar"] = "'model/1/model.py' links outside the model folder"
    with tarfile.open(tmp_path / "dev.tar", "w") as tf:
        info = tarfile.TarInfo("model/dev")
        info.type = tarfile.CHRTYPE
        tf.addfile(info)
    cases["dev.tar"] = "'model/dev' is not a file or folder"
    (tmp_path / "junk.tar.gz").write_bytes(b"not an archive")
    cases["junk.tar.gz"] = "not a tar or zip archive"
    for filename, message in cases.items():
        dest = tmp_path / ("out-" + filename)
        dest.mkdir()
        with pytest.raises(StorageError, match=re.escape(message)):
            extract(tmp_path / filename, dest, f"https://h/{filename}")
        assert not (tmp_path / "outside.txt").exists()


def test_a_folder_without_config_or_model_file_fails_with_its_reason(serve, minio, bucket):
    name, client = bucket
    client.put_object(Bucket=name, Key="repo/stray/1/notes.txt", Body=b"no model here")
    put_model(client, name, "repo", "fine", factor=3.0)
    server = serve([f"s3://{minio.host}/{name}/repo"], "--strict-readiness", "false")
    assert infer(server, "fine") == 3.0
    entry = next(e for e in index(server) if e["name"] == "stray")
    assert entry["state"] == "UNAVAILABLE"
    assert "no backend or platform in config.pbtxt and no model file" in entry["reason"], entry
