"""--http-restricted-api / --grpc-restricted-protocol values read from the environment or a file (env:, file:),
so the credential is never on the server's command line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from helpers import ROOT, NaiadProcess
from tritonclient.utils import InferenceServerException

CREDENTIAL = "c0ntrol-Cred3ntial-from-a-Secret"


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("restricted-repo")
    shutil.copytree(ROOT / "tests" / "models" / "add_sub", out / "add_sub")
    return out


def test_credential_from_env_and_file_never_on_the_command_line(repo, tmp_path, monkeypatch):
    secret_file = tmp_path / "credential"
    secret_file.write_text(CREDENTIAL + "\n")  # as a Secret's key is often written
    monkeypatch.setenv("NAIAD_TEST_CONTROL_CREDENTIAL", CREDENTIAL)
    groups = "model-repository,shared-memory,logging,trace"
    with NaiadProcess(
        repo,
        "--model-control-mode",
        "explicit",
        "--load-model",
        "add_sub",
        "--http-restricted-api",
        f"{groups}:naiad-control-key=env:NAIAD_TEST_CONTROL_CREDENTIAL",
        "--grpc-restricted-protocol",
        f"{groups}:naiad-control-key=file:{secret_file}",
    ) as proc:
        cmdline = Path(f"/proc/{proc.proc.pid}/cmdline").read_bytes()
        assert CREDENTIAL.encode() not in cmdline and b"env:NAIAD_TEST_CONTROL_CREDENTIAL" in cmdline
        good = {"naiad-control-key": CREDENTIAL}
        for path in (
            "/v2/repository/models/add_sub/unload",
            "/v2/repository/index",
            "/v2/logging",
            "/v2/trace/setting",
        ):
            r = requests.post(f"{proc.url}{path}", json={})
            assert r.status_code == 403, path
            assert "naiad-control-key" in r.json()["error"] and CREDENTIAL not in r.text
            # the literal reference is not the credential
            r = requests.post(
                f"{proc.url}{path}",
                json={},
                headers={"naiad-control-key": "env:NAIAD_TEST_CONTROL_CREDENTIAL"},
            )
            assert r.status_code == 403, path
        assert requests.post(f"{proc.url}/v2/repository/index", headers=good).status_code == 200
        assert requests.get(f"{proc.url}/v2/systemsharedmemory/status").status_code == 403

        client = grpcclient.InferenceServerClient(proc.grpc)
        with pytest.raises(InferenceServerException, match="PERMISSION_DENIED|restricted"):
            client.unload_model("add_sub")
        with pytest.raises(InferenceServerException, match="PERMISSION_DENIED|restricted"):
            client.register_system_shared_memory("r", "/naiad-test-region", 16)
        # inference and health stay open
        assert client.is_server_ready()
        a = grpcclient.InferInput("INPUT0", [4], "FP32")
        a.set_data_from_numpy(np.ones(4, dtype=np.float32))
        b = grpcclient.InferInput("INPUT1", [4], "FP32")
        b.set_data_from_numpy(np.ones(4, dtype=np.float32))
        assert client.infer("add_sub", [a, b]).as_numpy("OUTPUT0").tolist() == [2.0] * 4
        client.unload_model("add_sub", headers=good)
        assert not client.is_model_ready("add_sub")
        client.close()


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "env:NAIAD_TEST_UNSET_CREDENTIAL",
            "env:NAIAD_TEST_UNSET_CREDENTIAL: the environment variable is not set",
        ),
        ("file:/nonexistent/naiad-credential", "file:/nonexistent/naiad-credential: No such file"),
    ],
)
def test_missing_credential_source_stops_the_server_with_a_clear_error(repo, value, message, monkeypatch):
    monkeypatch.delenv("NAIAD_TEST_UNSET_CREDENTIAL", raising=False)
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
            "--http-restricted-api",
            f"model-repository:naiad-control-key={value}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT / "server"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert message in done.stderr
