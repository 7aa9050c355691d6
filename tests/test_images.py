"""The built images run (`make images`): each is unpacked from its docker-archive and started with its own
entrypoint, user, working directory and environment (bubblewrap over the unpacked root file system), as a
container runtime would start it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
from helpers import ROOT, free_ports

IMAGES = Path(os.environ.get("NAIAD_IMAGES_OUT", ROOT / "build" / "images"))
TOOLS = ("skopeo", "umoci", "bwrap")


def _missing() -> str | None:
    if os.geteuid() != 0:
        return (
            "unpacking and running an image's root file system needs root (CI and the dev machines are root)"
        )
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} missing: `make images` installs them"
    return None


def unpack(archive: Path, dest: Path) -> tuple[Path, dict]:
    """docker-archive -> OCI layout -> runtime bundle; returns (rootfs, the OCI runtime config's process)."""
    if not archive.exists():
        pytest.fail(f"{archive} missing: `make images` builds it (make test runs it first)")
    subprocess.run(
        ["skopeo", "copy", "--quiet", f"docker-archive:{archive}", f"oci:{dest}/oci:img"], check=True
    )
    subprocess.run(["umoci", "unpack", "--image", f"{dest}/oci:img", str(dest / "bundle")], check=True)
    process = json.loads((dest / "bundle" / "config.json").read_text())["process"]
    inspect = ["skopeo", "inspect", "--config", f"docker-archive:{archive}"]
    image = json.loads(subprocess.run(inspect, check=True, capture_output=True).stdout)["config"]
    # the image's ENTRYPOINT and CMD kept apart: a pod's `args` replace CMD only
    process["entrypoint"], process["cmd"] = image.get("Entrypoint") or [], image.get("Cmd") or []
    return dest / "bundle" / "rootfs", process


class Container:
    """One process of an unpacked image: its args, env, cwd and uid/gid, bind mounts like a pod's volumes."""

    def __init__(self, rootfs: Path, process: dict, args: list[str] | None = None, mounts=()):
        self.rootfs, self.process = rootfs, process
        # a pod's `args` replace the image's CMD and keep its ENTRYPOINT
        argv = [*process["entrypoint"], *(process["cmd"] if args is None else args)]
        user = process["user"]
        cmd = ["bwrap", "--bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        cmd += ["--die-with-parent", "--clearenv", "--chdir", process.get("cwd", "/")]
        for src, dst in mounts:
            cmd += ["--ro-bind", str(src), dst]
        for item in process.get("env", []):
            key, _, value = item.partition("=")
            cmd += ["--setenv", key, value]
        cmd += ["--", "/usr/bin/setpriv", "--reuid", str(user["uid"]), "--regid", str(user["gid"])]
        cmd += ["--clear-groups", "--", *argv]
        self.cmd = cmd
        self.log = open(rootfs.parent.parent / "container.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return (self.rootfs.parent.parent / "container.log").read_text(errors="replace")

    def main_process(self) -> psutil.Process:
        """The image's entrypoint process (bwrap's child, after setpriv exec'd it)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            children = psutil.Process(self.proc.pid).children(recursive=True)
            if children:
                return children[-1]
            time.sleep(0.05)
        raise AssertionError(f"no process inside the container:\n{self.output()}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            try:
                self.main_process().send_signal(sig)
            except (psutil.Error, AssertionError):
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


@pytest.fixture(scope="module")
def server_image(tmp_path_factory):
    return unpack(IMAGES / "naiad-server.tar", tmp_path_factory.mktemp("server-image"))


@pytest.fixture(scope="module")
def example_repo() -> Path:
    repo = ROOT / "examples" / "model_repository"
    if not (repo / ".built").exists():
        pytest.fail("examples/model_repository missing: `make examples` builds it (make test runs it first)")
    return repo


def test_server_image_serves_the_example_repository_as_non_root(server_image, example_repo):
    rootfs, process = server_image
    assert process["user"]["uid"] == 10001 and process["cwd"] == "/home/naiad"
    assert process["args"][0] == "naiad" and "--model-repository=/models" in process["args"]
    http, grpc, metrics = free_ports(3)
    # What the chart passes: the image's entrypoint, its own flags, the repository at /models.
    args = ["serve", "--model-repository=/models", "--model-control-mode=explicit"]
    args += ["--load-model=simple_onnx", "--load-model=identity_python", "--log-verbose=1"]
    args += [f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"]
    c = Container(rootfs, process, args, mounts=[(example_repo, "/models")])
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
    rootfs, process = server_image
    env = dict(item.partition("=")[::2] for item in process["env"])
    assert env["PATH"].startswith("/opt/naiad/bin") and env["PYTHONDONTWRITEBYTECODE"] == "1"
    for tool in ("gcc", "cc", "make", "pip", "pip3"):
        for d in ("usr/bin", "usr/local/bin", "opt/naiad/bin"):
            assert not (rootfs / d / tool).exists(), f"{d}/{tool} left in the image"
    assert not list((rootfs / "root").glob(".cache/pip*")), "pip cache left in the image"
    assert not (rootfs / "src").exists() and not (rootfs / "opt/naiad/tests").exists()
    assert not list(rootfs.glob("opt/naiad/lib/python3*/site-packages/naiad/**/__pycache__"))


def test_operator_image_starts(tmp_path_factory):
    rootfs, process = unpack(IMAGES / "naiad-operator.tar", tmp_path_factory.mktemp("operator-image"))
    assert process["user"]["uid"] == 10001 and process["args"][0] == "naiad-operator"
    c = Container(rootfs, process, ["--help"])
    c.proc.wait(60)
    c.stop()
    assert c.proc.returncode == 0, c.output()
    assert "naiad-operator" in c.output() or "usage" in c.output().lower()
