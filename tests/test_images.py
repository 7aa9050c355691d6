"""The built images run (`make images`): each is unpacked from its docker-archive and started with its own
entrypoint, user, working directory and environment (bubblewrap over the unpacked root file system), as a
container runtime would start it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
from helpers import ROOT, free_ports
from llm_models import write_llamacpp_model

from e2e.images import (
    ContainerSpec,
    ImageError,
    ImageStore,
    Mount,
    container_processes,
    main_process,
    missing_tools,
    pid_namespace,
    processes_in,
    stop_container,
)

IMAGES = Path(os.environ.get("NAIAD_IMAGES_OUT", ROOT / "build" / "images"))
SERVER = "ghcr.io/naiad-dev/naiad-server:0.1.0"
OPERATOR = "ghcr.io/naiad-dev/naiad-operator:0.1.0"
SERVER_LLM = "ghcr.io/naiad-dev/naiad-server:0.1.0-llm"  # Dockerfile.llm (`make images-llm`)


def _missing() -> str | None:
    return missing_tools()


class Container:
    """One process of an unpacked image (e2e/images.py starts it as the e2e pod runner does)."""

    def __init__(
        self, image, args: list[str] | None = None, mounts=(), log_dir: Path | None = None, command=None
    ):
        self.image = image
        spec = ContainerSpec(
            image, command=command, args=args, mounts=[Mount(Path(s), d, True) for s, d in mounts]
        )
        self.log_path = (log_dir or image.rootfs.parent.parent) / "container.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            spec.argv(), env=spec.full_env(), stdout=self.log, stderr=subprocess.STDOUT
        )
        self.pidns = pid_namespace(self.proc.pid)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def main_process(self) -> psutil.Process:
        """The image's entrypoint process (PID 2 of the container, after setpriv exec'd it)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            main = main_process(self.proc.pid)
            if main is not None:
                return main
            time.sleep(0.05)
        raise AssertionError(f"no process inside the container:\n{self.output()}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        code = stop_container(self.proc, self.pidns, grace=timeout, sig=sig)
        self.log.close()
        return code


pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


@pytest.fixture(scope="module")
def store():
    return ImageStore.from_build(IMAGES)  # unpacked once per image ID (~/.cache/naiad-e2e-images)


def _get(store: ImageStore, name: str):
    try:
        return store.get(name)
    except ImageError as e:
        pytest.fail(f"{e} (make test runs `make images` first)")


@pytest.fixture(scope="module")
def server_image(store):
    return _get(store, SERVER)


@pytest.fixture(scope="module")
def example_repo() -> Path:
    repo = ROOT / "examples" / "model_repository"
    if not (repo / ".built").exists():
        pytest.fail("examples/model_repository missing: `make examples` builds it (make test runs it first)")
    return repo


def test_server_image_serves_the_example_repository_as_non_root(server_image, example_repo, tmp_path):
    image = server_image
    assert (image.uid, image.cwd) == (10001, "/home/naiad")
    assert image.entrypoint == ["naiad"] and "--model-repository=/models" in image.cmd
    http, grpc, metrics = free_ports(3)
    # What the chart passes: the image's entrypoint, its own flags, the repository at /models.
    args = ["serve", "--model-repository=/models", "--model-control-mode=explicit"]
    args += ["--load-model=simple_onnx", "--load-model=identity_python", "--log-verbose=1"]
    args += [f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"]
    c = Container(image, args, mounts=[(example_repo, "/models")], log_dir=tmp_path)
    try:
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert c.proc.poll() is None, c.output()
            time.sleep(0.2)
        else:
            raise AssertionError(f"server image not ready:\n{c.output()}")
        main = c.main_process()
        assert main.uids().real == 10001 and main.uids().effective == 10001, (
            "runs as the image's non-root user"
        )
        assert main.cwd() == "/home/naiad" or main.cwd().endswith("/home/naiad")
        # the seed tutorial's requests.post, to the tutorial's model exported to ONNX (the CPU image has no torch)
        body = {
            "inputs": [
                {"name": "input_ids", "shape": [2, 3], "datatype": "INT64", "data": [[1, 2, 3], [4, 5, 6]]}
            ]
        }
        res = requests.post(f"{url}/v2/models/simple_onnx/infer", json=body, timeout=30)
        assert res.status_code == 200, res.text
        assert [(o["name"], o["shape"]) for o in res.json()["outputs"]] == [
            ("output1", [2, 3, 4]),
            ("output2", [2, 3, 8]),
        ]
        # a tritonclient gRPC call
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        out = client.infer("identity_python", [inp]).as_numpy("OUTPUT0")
        assert out.tolist() == [[0.0, 1.0, 2.0, 3.0]]
        client.close()
        scrape = requests.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
        assert 'nv_inference_request_success{model="simple_onnx",version="1"} 1' in scrape
    finally:
        code = c.stop(signal.SIGTERM)
    assert code == 0, f"SIGTERM must drain and exit 0, got {code}:\n{c.output()[-3000:]}"
    assert "shutting down" in c.output()


def test_server_image_contents(server_image):
    rootfs, env = server_image.rootfs, server_image.env_dict
    assert env["PATH"].startswith("/opt/naiad/bin") and env["PYTHONDONTWRITEBYTECODE"] == "1"
    for tool in ("gcc", "cc", "make", "pip", "pip3"):
        for d in ("usr/bin", "usr/local/bin", "opt/naiad/bin"):
            assert not (rootfs / d / tool).exists(), f"{d}/{tool} left in the image"
    assert not list((rootfs / "root").glob(".cache/pip*")), "pip cache left in the image"
    assert not (rootfs / "src").exists() and not (rootfs / "opt/naiad/tests").exists()
    assert not list(rootfs.glob("opt/naiad/lib/python3*/site-packages/naiad/**/__pycache__"))


def _wait_ready(c: Container, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        assert c.proc.poll() is None, c.output()
        time.sleep(0.2)
    raise AssertionError(f"server not ready:\n{c.output()}")


def test_llm_server_image_serves_a_gguf_with_layers_on_its_rpc_server(store, tmp_path):
    """The LLM image (`make images-llm`): llama.cpp's rpc-server runs from it (a LeaderWorkerSet's worker), and its
    Naiad loads a GGUF with llama-cpp-python, offloads the layers to that rpc-server (the group's leader) and answers
    an OpenAI chat completion, as the image's non-root user."""
    image = _get(store, SERVER_LLM)
    assert (image.uid, image.cwd, image.entrypoint) == (10001, "/home/naiad", ["naiad"])
    rootfs = image.rootfs
    for tool in ("gcc", "cc", "make", "pip", "pip3"):
        for d in ("usr/bin", "usr/local/bin", "opt/naiad/bin"):
            assert not (rootfs / d / tool).exists(), f"{d}/{tool} left in the image"
    assert not (rootfs / "tmp/llm").exists() and not list((rootfs / "var/lib/apt/lists").glob("*_Packages"))

    for d in ("help", "rpc"):
        (tmp_path / d).mkdir()
    helped = Container(image, command=["rpc-server", "--help"], log_dir=tmp_path / "help")
    helped.proc.wait(60)
    helped.stop()
    assert helped.proc.returncode == 0 and "--port" in helped.output(), helped.output()

    rpc_port, http, grpc, metrics = free_ports(4)
    repo = tmp_path / "repo"
    write_llamacpp_model(
        repo / "tiny_llm",
        f'parameters {{ key: "rpc_servers" value: {{ string_value: "127.0.0.1:{rpc_port}" }} }}\n',
    )
    worker = Container(
        image,
        command=["rpc-server", "--host", "127.0.0.1", "--port", str(rpc_port)],
        log_dir=tmp_path / "rpc",
    )
    leader = None
    try:
        deadline = time.monotonic() + 30
        while not _port_accepts(rpc_port):
            assert time.monotonic() < deadline and worker.proc.poll() is None, worker.output()
            time.sleep(0.2)
        args = [
            "serve",
            "--model-repository=/models",
            "--model-control-mode=explicit",
            "--load-model=tiny_llm",
        ]
        args += [f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"]
        leader = Container(image, args, mounts=[(repo, "/models")], log_dir=tmp_path)
        url = f"http://127.0.0.1:{http}"
        _wait_ready(leader, url)
        assert requests.get(f"{url}/v2/models/tiny_llm/ready", timeout=10).status_code == 200, leader.output()
        body = {"model": "tiny_llm", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        res = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert res.status_code == 200, res.text
        assert res.json()["usage"]["completion_tokens"] >= 1
        # the leader connected (after the readiness probe's connection) and the worker still serves
        assert worker.output().count("Accepted client connection") >= 2, worker.output()
        assert worker.proc.poll() is None
    finally:
        if leader is not None:
            assert leader.stop(signal.SIGTERM) == 0, leader.output()[-3000:]
        worker.stop(signal.SIGTERM, timeout=5)


def _port_accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_operator_image_starts(store, tmp_path):
    image = _get(store, OPERATOR)
    assert image.uid == 10001 and image.entrypoint == ["naiad-operator"]
    c = Container(image, ["--help"], log_dir=tmp_path)
    c.proc.wait(60)
    c.stop()
    assert c.proc.returncode == 0, c.output()
    assert "naiad-operator" in c.output() or "usage" in c.output().lower()


# A command that leaves a process behind which outlives it and ignores SIGTERM: a daemonised child in a session of
# its own, holding a listening socket (what a forked helper or a stray worker of a server does to a pod IP's port).
DAEMON = """
import os, signal, socket, sys, time
port = int(sys.argv[1])
if os.fork() == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    print("daemon listening", flush=True)
    while True:
        time.sleep(1)
time.sleep(600)
"""


def _port_free(port: int) -> bool:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _daemon_container(image, tmp_path) -> tuple[Container, int]:
    (port,) = free_ports(1)
    c = Container(image, command=["python", "-c", DAEMON, str(port)], log_dir=tmp_path)
    deadline = time.monotonic() + 30
    while "daemon listening" not in c.output():
        assert time.monotonic() < deadline and c.proc.poll() is None, c.output()
        time.sleep(0.05)
    # the command and its daemon, as the image's user (besides them: the namespace's PID 1, bwrap's reaper)
    procs = [p for p in container_processes(c.proc.pid) if p.uids().real == 10001]
    assert len(procs) == 2, procs
    assert not _port_free(port)
    return c, port


def test_killing_bwrap_takes_the_whole_container_with_it(server_image, tmp_path):
    """A SIGKILLed bwrap (a test killing "the container", a runner killed mid-run) must not leave the container's
    processes running: before each container had a PID namespace of its own, setpriv's change of user cleared
    bwrap's parent-death signal and the server went on as uid 10001 with its ports bound."""
    c, port = _daemon_container(server_image, tmp_path)
    # taken before the kill, so that one which has exited by the time of the wait counts as gone (not as an error)
    procs = container_processes(c.proc.pid)
    assert procs
    c.proc.kill()
    c.proc.wait()
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"container processes outlived bwrap: {alive}"
    assert processes_in(c.pidns) == [] and _port_free(port)
    c.log.close()


def test_stop_leaves_no_process_and_frees_the_port(server_image, tmp_path):
    """The runtime's stop (SIGTERM to the command, SIGKILL after the grace period) returns only once every process
    of the container has exited, daemonised and SIGTERM-ignoring ones included, so the port can be bound again."""
    c, port = _daemon_container(server_image, tmp_path)
    started = time.monotonic()
    code = c.stop(signal.SIGTERM, timeout=2)
    assert code == 128 + signal.SIGTERM, c.output()  # the command died of SIGTERM, its daemon of the SIGKILL
    assert time.monotonic() - started < 10
    assert processes_in(c.pidns) == [], "a process of the stopped container is left"
    assert _port_free(port), "the stopped container's port is still bound"


def test_a_file_is_mounted_over_a_path_the_image_lacks(server_image, tmp_path):
    """A pod's /etc/hosts (the kubelet mounts one; the image has none): a file bound at a file's path, read live."""
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.7 w-1.g.ns\n")
    script = "import socket; print('resolved', socket.gethostbyname('w-1.g.ns'))"
    c = Container(
        server_image, command=["python", "-c", script], mounts=[(hosts, "/etc/hosts")], log_dir=tmp_path
    )
    c.proc.wait(60)
    c.stop()
    assert c.proc.returncode == 0 and "resolved 10.0.0.7" in c.output(), c.output()
    assert (server_image.rootfs / "etc" / "hosts").is_file()  # the empty mount point, in the unpacked copy


def test_unpacked_images_unused_for_days_are_pruned(tmp_path):
    """Each rebuilt image unpacks to a new directory (~400 MB): the cache keeps what runs used recently."""
    recent, old = tmp_path / "recent", tmp_path / "old"
    for d in (recent, old):
        (d / "bundle").mkdir(parents=True)
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    assert ImageStore({}, cache_dir=tmp_path).prune(keep_days=2) == [old]
    assert recent.exists() and not old.exists()
