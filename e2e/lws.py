"""The LeaderWorkerSet controller (sigs.k8s.io/lws, built by tools/go/build.sh lws) as a local process against an
e2e cluster, with its admission webhooks served: they are not optional, since the pod webhook is what gives a
group's pods their LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX and worker-index labels.

In a cluster the webhooks are reached through a Service and the controller makes its own certificate (its
internalCertManagement). Here there is no Service routing (no kube-proxy), so this module makes a CA and a serving
certificate for 127.0.0.1, turns the controller's certificate management off, has it serve the webhooks on a free
local port, and registers the CRD's webhooks with `clientConfig.url` at that port and the CA as `caBundle` (the API
server runs in the same network namespace). The pod webhooks get an objectSelector so that they only see the pods
of a LeaderWorkerSet, as the LWS chart's do. Leader election is off (one controller), metrics are off.
"""

from __future__ import annotations

import base64
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from .cluster import ClusterError, KwokCluster
from .local_process import free_port, tool_output, wait_crd_established, write_serving_certificate

ROOT = Path(__file__).resolve().parent.parent
WEBHOOK_CONFIGURATIONS = ("naiad-e2e-lws-mutating", "naiad-e2e-lws-validating")
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


def controller_binary() -> Path:
    """The controller from the cache (built from its Go module once, minutes on a cold cache)."""
    return (
        Path(tool_output(["bash", str(ROOT / "tools" / "go" / "build.sh"), "lws"], 3600)) / "lws-controller"
    )


def manifests_dir() -> Path:
    """The CRD and webhook manifests of the same LWS release (tools/lws/crds.sh)."""
    return Path(tool_output(["bash", str(ROOT / "tools" / "lws" / "crds.sh")], 600))


def local_webhooks(manifests: Path, port: int, ca: bytes) -> list[dict[str, Any]]:
    """The release's webhook configurations, pointed at https://127.0.0.1:<port>; pod webhooks only for the pods
    of a LeaderWorkerSet."""
    bundle = base64.b64encode(ca).decode()
    out = []
    for doc, name in zip(
        yaml.safe_load_all((manifests / "webhook" / "manifests.yaml").read_text()), WEBHOOK_CONFIGURATIONS
    ):
        doc["metadata"] = {"name": name}
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = {"matchExpressions": [{"key": LWS_NAME_LABEL, "operator": "Exists"}]}
        out.append(doc)
    return out


class LwsController:
    """`start()` installs the CRD and webhooks and runs the controller; `stop()` ends it and removes the webhooks
    (so that a cluster outliving it does not refuse LeaderWorkerSets)."""

    def __init__(self, cluster: KwokCluster, workdir: Path, binary: Path, manifests: Path):
        self.cluster = cluster
        self.workdir = workdir
        self.binary = binary
        self.manifests = manifests
        self.port = free_port()
        self.health_port = free_port()
        self.log_path = workdir / "lws-controller.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ca = write_serving_certificate(self.workdir / "certs")
        config = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": self.port, "certDir": str(self.workdir / "certs")},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
        }
        config_path = self.workdir / "lws-config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        self.cluster.kubectl("apply", "--server-side", "-f", str(self.manifests / "crds"))
        wait_crd_established(self.cluster, "leaderworkersets.leaderworkerset.x-k8s.io")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), f"--config={config_path}", f"--kubeconfig={self.cluster.kubeconfig}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_serving(timeout)
        for doc in local_webhooks(self.manifests, self.port, ca):
            self.cluster.apply(doc)

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ClusterError(f"lws-controller exited {self.proc.returncode}: {self.log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.3)
        raise ClusterError(f"lws-controller does not serve its webhooks on {self.port}: {self.log()}")

    def log(self, chars: int = 4000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        for name, kind in zip(
            WEBHOOK_CONFIGURATIONS, ("mutatingwebhookconfiguration", "validatingwebhookconfiguration")
        ):
            self.cluster.kubectl("delete", kind, name, "--ignore-not-found", check=False)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
