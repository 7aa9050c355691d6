"""A vLLM copy over the pods of a LeaderWorkerSet group (`python -m naiad.llm.ray_group`): real Ray, a head and a
worker node on this machine standing in for the leader's and the worker's pods. The leader starts the server only
once the group's nodes are alive, and the engine (the vllm stand-in, which joins the cluster and counts its GPUs
as vLLM's Ray executor does) sees the GPUs of both; a group that does not form is given up with a clear error."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
from helpers import ROOT

STANDINS = ROOT / "tests" / "standins"
RAY = Path(sys.executable).parent / "ray"
CONFIG = """backend: "vllm"
instance_group [ { kind: KIND_MODEL } ]
parameters { key: "tensor_parallel_size" value: { string_value: "2" } }
parameters { key: "pipeline_parallel_size" value: { string_value: "2" } }
parameters { key: "distributed_executor_backend" value: { string_value: "ray" } }
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def site(tmp_path):
    shutil.copytree(STANDINS / "vllm", tmp_path / "site" / "vllm")
    repo = tmp_path / "models"
    (repo / "llm" / "1").mkdir(parents=True)
    (repo / "llm" / "config.pbtxt").write_text(CONFIG)
    (repo / "llm" / "1" / "model.json").write_text('{"model": "stand-in"}')
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'server'}:{tmp_path / 'site'}", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    yield repo, env
    subprocess.run([str(RAY), "stop", "--force"], capture_output=True, timeout=60)


def ray_group(role: str, *args: str, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "naiad.llm.ray_group", role, *args],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


UPSTREAM_VLLM_BACKEND = ROOT / "tests" / "third_party" / "vllm_backend" / "src"


def triton_repository(tmp_path: Path) -> tuple[Path, list[str]]:
    """A Triton LLM repository over the group (the operator's `engine: triton`): Triton's own vllm_backend model.py
    as the python-based backend `vllm`, and a model.json that asks for the sizes and Ray's executor itself."""
    shutil.copytree(UPSTREAM_VLLM_BACKEND, tmp_path / "backends" / "vllm")
    repo = tmp_path / "triton_models"
    (repo / "llm" / "1").mkdir(parents=True)
    (repo / "llm" / "config.pbtxt").write_text('backend: "vllm"\n')
    engine = (
        '{"model": "stand-in", "tensor_parallel_size": 2, "pipeline_parallel_size": 2, '
        '"distributed_executor_backend": "ray"}'
    )
    (repo / "llm" / "1" / "model.json").write_text(engine)
    return repo, [f"--backend-directory={tmp_path / 'backends'}"]


@pytest.mark.parametrize("repository", ["naiad", "triton"])
def test_the_leader_serves_once_the_group_has_joined(site, tmp_path, repository):
    """Naiad's vllm backend (the parallel sizes from the load's config), and Triton's vllm_backend model.py (from
    its model.json), whose engine runs in the python backend's stub process and joins the cluster from there."""
    repo, env = site
    extra: list[str] = []
    if repository == "triton":
        pytest.importorskip("PIL", reason="vllm_backend's utils/request.py imports Pillow")
        repo, extra = triton_repository(tmp_path)
    ray_port, http = free_port(), free_port()
    node = [
        "--num-gpus=2",
        "--num-cpus=1",
        f"--port={ray_port}",
        "--timeout=120",
        "--token-from-env=GROUP_SECRET",
    ]
    env = dict(env, GROUP_SECRET="the pool's control credential")
    # the worker first, as the LeaderWorkerSet may start it: it retries until the head is up
    worker = ray_group("worker", "--leader=127.0.0.1", *node, env=env, log=tmp_path / "worker.log")
    time.sleep(1)
    serve = [sys.executable, "-m", "naiad.cli", "serve", "--model-repository", str(repo), "--http-port", str(http),
             "--grpc-port", str(free_port()), "--allow-metrics", "false", *extra]  # fmt: skip
    leader = ray_group("leader", "--size=2", *node, "--", *serve, env=env, log=tmp_path / "leader.log")
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            assert leader.poll() is None, (tmp_path / "leader.log").read_text()[-3000:]
            try:
                if requests.get(f"http://127.0.0.1:{http}/v2/models/llm/ready", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError((tmp_path / "leader.log").read_text()[-3000:])
        out = (tmp_path / "leader.log").read_text()
        assert "the group's 2 Ray nodes are alive" in out
        assert "tensor_parallel_size=2 pipeline_parallel_size=2" in out
        assert "ray executor over 2 nodes with 4 GPUs" in out  # the engine sees the worker pod's GPUs too
        r = requests.post(
            f"http://127.0.0.1:{http}/v2/models/llm/generate",
            json={"text_input": "a b", "parameters": {"max_tokens": 2}},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["text_output"] == "a b b a", r.text
        assert worker.poll() is None  # in the foreground while its node lives
        # token authentication: a driver without the group's token is refused
        probe = f"import ray; ray.init(address='127.0.0.1:{ray_port}', logging_level='ERROR')"
        without = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
        r = subprocess.run(
            [sys.executable, "-c", probe], env=without, capture_output=True, text=True, timeout=120
        )
        assert r.returncode != 0 and "ConnectionError" in r.stderr, r.stderr[-2000:]
        # a pod's stop: SIGTERM reaches the worker's Ray node, which drains and exits, and so does the worker
        os.kill(worker.pid, signal.SIGTERM)
        worker.wait(60)
        address = f"--address=127.0.0.1:{ray_port}"
        deadline = time.monotonic() + 30
        while any(address in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])):
            assert time.monotonic() < deadline, "the worker's `ray start` outlived it"
            time.sleep(0.5)
    finally:
        stop(leader)
        stop(worker)


def test_the_leader_gives_up_on_a_group_that_does_not_form(site, tmp_path):
    _, env = site
    leader = ray_group(
        "leader", "--size=2", "--num-cpus=1", f"--port={free_port()}", "--timeout=5", "--", "true",
        env=env, log=tmp_path / "leader.log",
    )  # fmt: skip
    try:
        assert leader.wait(120) == 1
    finally:
        stop(leader)
    assert "1 of the group's 2 Ray nodes joined within 5 s" in (tmp_path / "leader.log").read_text()


def test_usage_errors(site):
    _, env = site
    for args, message in [
        (["worker", "--leader=x", "--token-from-env=NO_SUCH_VARIABLE"], "refusing an open cluster"),
        (["leader", "--size=2"], "the command to run once the group is up goes after --"),
        (["worker", "--leader=x", "--", "true"], "worker: takes no command"),
        (["leader", "--size=0", "--", "true"], "--size must be at least 1"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "naiad.llm.ray_group", *args], env=env, capture_output=True, text=True
        )
        assert r.returncode in (1, 2) and message in r.stderr, r.stderr
