"""The llamacpp backend over llama.cpp's RPC backend: a model's layers offloaded to a real `rpc-server` (built
from the same llama.cpp by tools/llama_cpp/build.sh rpc), named by the model's `rpc_servers` parameter or by
$NAIAD_LLAMACPP_RPC_SERVERS (what the operator gives a LeaderWorkerSet's leader); greedy output matches the same
model run locally."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests
from helpers import ROOT, NaiadProcess, free_ports
from llm_models import write_tiny_gguf

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)"
)

from naiad.backends.llamacpp.rpc import parse_rpc_servers
from naiad.errors import InvalidArgument

ONE_THREAD = 'parameters { key: "n_threads" value: { string_value: "1" } }\n'


def rpc_server_binary() -> Path:
    """llama.cpp's rpc-server from the cached build (built once, several minutes, when missing)."""
    out = subprocess.run(
        ["bash", str(ROOT / "tools" / "llama_cpp" / "build.sh"), "rpc"],
        capture_output=True,
        text=True,
        timeout=3600,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1]) / "bin" / "rpc-server"


@pytest.fixture(scope="module")
def rpc_server(tmp_path_factory):
    binary = rpc_server_binary()
    (port,) = free_ports(1)
    log_path = tmp_path_factory.mktemp("rpc") / "rpc-server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(binary), "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"rpc-server did not start: {log_path.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield f"127.0.0.1:{port}", log_path
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def naiad(tmp_path_factory, rpc_server):
    endpoint, _ = rpc_server
    (dead,) = free_ports(1)  # nothing listens there
    repo = tmp_path_factory.mktemp("rpc_repo")
    models = {
        "local": "",
        "remote": f'parameters {{ key: "rpc_servers" value: {{ string_value: "{endpoint}" }} }}\n',
        "from_env": "",  # $NAIAD_LLAMACPP_RPC_SERVERS, as the operator sets it on a group's leader
        "unreachable": (
            f'parameters {{ key: "rpc_servers" value: {{ string_value: "127.0.0.1:{dead}" }} }}\n'
            'parameters { key: "rpc_wait_seconds" value: { string_value: "1" } }\n'
        ),
        "malformed": 'parameters { key: "rpc_servers" value: { string_value: "no-port" } }\n',
    }
    for name, extra in models.items():
        write_tiny_gguf(repo / name / "1" / "model.gguf")
        (repo / name / "config.pbtxt").write_text(f'backend: "llamacpp"\n{ONE_THREAD}{extra}')
    # models are loaded one at a time: an rpc-server serves one client connection, which ggml-rpc shares between
    # every model of the process that names that server (one model per group of pods, as the operator renders it)
    with NaiadProcess(
        repo,
        "--model-control-mode=explicit",
        timeout=120,
        env={"NAIAD_LLAMACPP_RPC_SERVERS": endpoint},
    ) as proc:
        yield proc


def load(naiad, model: str, config: dict | None = None) -> None:
    body = {"parameters": {"config": json.dumps(config)}} if config else {}
    r = requests.post(f"{naiad.url}/v2/repository/models/{model}/load", json=body, timeout=120)
    assert r.status_code == 200, r.text


def unload(naiad, model: str) -> None:
    r = requests.post(f"{naiad.url}/v2/repository/models/{model}/unload", timeout=60)
    assert r.status_code == 200, r.text


def generate(naiad, model: str) -> str:
    body = {"text_input": "the cat", "sampling_parameters": json.dumps({"max_tokens": 12, "temperature": 0})}
    r = requests.post(f"{naiad.url}/v2/models/{model}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["text_output"]


def test_layers_on_an_rpc_server_give_the_local_output(naiad, rpc_server):
    _, log_path = rpc_server
    load(naiad, "remote")
    remote = generate(naiad, "remote")
    unload(naiad, "remote")
    # the rpc-server was asked for its memory and given the model's buffers and graphs
    assert "Accepted client connection" in log_path.read_text()
    load(naiad, "from_env")
    from_env = generate(naiad, "from_env")
    unload(naiad, "from_env")
    # the same weights run locally: the server process has the variable, so `local` is loaded with rpc_servers
    # given as an env: reference to a variable that is not set (no servers)
    config = {
        "backend": "llamacpp",
        "parameters": {
            "n_threads": {"string_value": "1"},
            "rpc_servers": {"string_value": "env:NAIAD_TEST_NO_SUCH_VARIABLE"},
        },
    }
    load(naiad, "local", config)
    local = generate(naiad, "local")
    assert remote == from_env == local and remote


def test_an_rpc_server_that_does_not_answer_fails_the_load(naiad):
    r = requests.post(f"{naiad.url}/v2/repository/models/unreachable/load", timeout=60)
    assert r.status_code >= 400 and "does not answer" in r.json()["error"], r.text
    r = requests.post(f"{naiad.url}/v2/repository/models/malformed/load", timeout=60)
    assert r.status_code == 400 and "is not host:port" in r.json()["error"], r.text


@pytest.mark.parametrize(
    "raw, problem",
    [("a:1,a:1", "twice"), ("host", "host:port"), ("h:99999", "host:port"), ("env:", "names no variable")],
)
def test_rpc_servers_parameter_errors(raw, problem):
    with pytest.raises(InvalidArgument, match=problem):
        parse_rpc_servers(raw)


def test_rpc_servers_parameter_forms(monkeypatch):
    monkeypatch.setenv("NAIAD_TEST_RPC", "w-1.g.ns:50052, w-2.g.ns:50052")
    assert parse_rpc_servers("env:NAIAD_TEST_RPC") == ["w-1.g.ns:50052", "w-2.g.ns:50052"]
    assert parse_rpc_servers("") == [] and parse_rpc_servers("env:NAIAD_TEST_UNSET_X") == []
    assert parse_rpc_servers("10.0.0.2:1") == ["10.0.0.2:1"]
