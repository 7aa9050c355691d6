"""KEDA's operator and its HTTP add-on (interceptor, external scaler, add-on operator), built by tools/go/build.sh
keda, as local processes against an e2e cluster: what wakes an InferenceServer at zero pods.

In a cluster they run as Deployments behind Services in the `keda` namespace and call each other by those
Services' DNS names. Here there is no kube-proxy and no cluster DNS, so:
- the names they dial are in a hosts file of theirs (e2e/poddns.py): the external scaler's Service (KEDA's
  ScaledObject names it as its scalerAddress) at 127.0.0.1, and every headless Service at its endpoints, as
  CoreDNS answers them (the interceptor forwards to a pool's headless Service; poddns.service_entries says why
  starting endpoints are named too);
- the interceptor's admin Service, whose EndpointSlices the scaler reads to find the interceptors it asks for
  their queues, has no selector and one EndpointSlice at an address of the pod network (the first node's
  InternalIP, local to this namespace) where the local interceptor's admin port answers;
- KEDA's metrics gRPC service (for its metrics API server, not run here) gets a CA and a certificate written here
  (KEDA's own rotation writes a Secret that a pod would mount, then exits for the kubelet to restart it), with
  the webhook and APIService patching off (neither is installed).
Leader election is off (one of each). A client sends a pool's requests to `proxy_url` with the pool's host name.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from .cluster import ClusterError, KwokCluster
from .local_process import free_port, tool_output, wait_crd_established, write_serving_certificate
from .poddns import PodHosts

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "keda"
INTERCEPTOR = "keda-add-ons-http-interceptor"
INTERCEPTOR_ADMIN = "keda-add-ons-http-interceptor-admin"
INTERCEPTOR_PROXY = "keda-add-ons-http-interceptor-proxy"
SCALER = "keda-add-ons-http-external-scaler"
CRDS_ESTABLISHED = ("scaledobjects.keda.sh", "httpscaledobjects.http.keda.sh")


def binaries() -> Path:
    """The bin directory of KEDA and the add-on (built from their Go modules once, minutes on a cold cache)."""
    return Path(tool_output(["bash", str(ROOT / "tools" / "go" / "build.sh"), "keda"], 3600))


def crds_dir() -> Path:
    """The CRDs of the same releases (tools/keda/crds.sh)."""
    return Path(tool_output(["bash", str(ROOT / "tools" / "keda" / "crds.sh")], 600))


class Keda:
    """`start()` installs the CRDs, the namespace and the interceptor's admin Service, then runs the four
    processes; `stop()` ends them. `admin_address`: an address of this network namespace that is valid in an
    EndpointSlice (not loopback)."""

    def __init__(self, cluster: KwokCluster, workdir: Path, bin_dir: Path, crds: Path, admin_address: str):
        self.cluster = cluster
        self.workdir = workdir
        self.bin_dir = bin_dir
        self.crds = crds
        self.admin_address = admin_address
        self.proxy_port, self.admin_port, self.scaler_port = free_port(), free_port(), free_port()
        self.keda_health_port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.hosts = PodHosts(
            lambda: self.cluster.kubectl("get", "pods", "-A", "-o", "json").stdout,
            workdir / "hosts",
            endpoint_slices=lambda: (
                self.cluster.kubectl(
                    "get", "endpointslices", "-A", "-l", "service.kubernetes.io/headless", "-o", "json"
                ).stdout
            ),
            static=[
                f"127.0.0.1 {SCALER}.{NAMESPACE}.svc.cluster.local {SCALER}.{NAMESPACE}.svc {SCALER}.{NAMESPACE}"
            ],
        )

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def start(self, timeout: float = 90) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cluster.kubectl("apply", "--server-side", "-f", str(self.crds))
        for crd in CRDS_ESTABLISHED:
            wait_crd_established(self.cluster, crd)
        self.cluster.apply(self._admin_objects())
        self.hosts.start()
        certs = self.workdir / "certs"
        (certs / "ca.crt").write_bytes(write_serving_certificate(certs))
        base = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)}
        self._run(
            "keda-http-add-on-scaler",
            {
                **base,
                "KEDA_HTTP_SCALER_PORT": str(self.scaler_port),
                "KEDA_HTTP_SCALER_TARGET_ADMIN_NAMESPACE": NAMESPACE,
                "KEDA_HTTP_SCALER_TARGET_ADMIN_SERVICE": INTERCEPTOR_ADMIN,
                "KEDA_HTTP_SCALER_TARGET_ADMIN_DEPLOYMENT": INTERCEPTOR,
                "KEDA_HTTP_SCALER_TARGET_ADMIN_PORT": str(self.admin_port),
            },
        )
        self._run(
            "keda-http-add-on-interceptor",
            {
                **base,
                "KEDA_HTTP_CURRENT_NAMESPACE": NAMESPACE,
                "KEDA_HTTP_PROXY_PORT": str(self.proxy_port),
                "KEDA_HTTP_ADMIN_PORT": str(self.admin_port),
                "OTEL_PROM_EXPORTER_PORT": str(free_port()),
            },
            with_hosts=True,
        )
        self._run(
            "keda-http-add-on-operator",
            {
                **base,
                "KEDA_HTTP_OPERATOR_NAMESPACE": NAMESPACE,
                "KEDAHTTP_OPERATOR_EXTERNAL_SCALER_SERVICE": SCALER,
                "KEDAHTTP_OPERATOR_EXTERNAL_SCALER_PORT": str(self.scaler_port),
                "KEDAHTTP_INTERCEPTOR_SERVICE": INTERCEPTOR_PROXY,
                "KEDAHTTP_INTERCEPTOR_PROXY_PORT": str(self.proxy_port),
                "KEDAHTTP_INTERCEPTOR_ADMIN_PORT": str(self.admin_port),
            },
            args=[
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                f"--health-probe-bind-address=127.0.0.1:{free_port()}",
            ],
        )
        self._run(
            "keda-operator",
            {
                **base,
                "WATCH_NAMESPACE": "",
                "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE,
                "POD_NAMESPACE": NAMESPACE,
            },
            args=[
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                f"--health-probe-bind-address=127.0.0.1:{self.keda_health_port}",
                f"--metrics-service-bind-address=127.0.0.1:{free_port()}",
                "--enable-cert-rotation=false",
                f"--cert-dir={certs}",
                "--enable-webhook-patching=false",
                "--enable-apiservice-patching=false",
            ],
            with_hosts=True,
        )
        self._wait_listening(timeout)
        self._wait_interceptor_ready(timeout)

    def _wait_interceptor_ready(self, timeout: float) -> None:
        """Until the interceptor's routing table has synced (its answer to the kubelet's probe, which keeps a pod
        that would answer 404 to every host out of its Service until then)."""
        request = urllib.request.Request(f"{self.proxy_url}/", headers={"User-Agent": "kube-probe/1.36"})
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(request, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the interceptor is not ready: {self.log('keda-http-add-on-interceptor')}"
                )
            time.sleep(0.3)

    def _admin_objects(self) -> list[dict]:
        return [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": INTERCEPTOR_ADMIN, "namespace": NAMESPACE},
                "spec": {"ports": [{"name": "admin", "port": self.admin_port, "protocol": "TCP"}]},
            },
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{INTERCEPTOR_ADMIN}-local",
                    "namespace": NAMESPACE,
                    "labels": {
                        "kubernetes.io/service-name": INTERCEPTOR_ADMIN,
                        "endpointslice.kubernetes.io/managed-by": "naiad-e2e",
                    },
                },
                "addressType": "IPv4",
                "endpoints": [{"addresses": [self.admin_address], "conditions": {"ready": True}}],
                "ports": [{"name": "admin", "port": self.admin_port, "protocol": "TCP"}],
            },
        ]

    def _run(
        self, name: str, env: dict[str, str], args: list[str] | None = None, with_hosts: bool = False
    ) -> None:
        binary = str(self.bin_dir / name)
        if with_hosts:  # the Service names it dials, as cluster DNS would answer them
            binary = str(self.hosts.launcher(binary, self.workdir / f"{name}-with-dns"))
        with open(self.workdir / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(
                [binary, *(args or [])], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for port in (self.scaler_port, self.admin_port, self.proxy_port, self.keda_health_port):
            while True:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise ClusterError(f"{name} exited {proc.returncode}: {self.log(name)}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise ClusterError(f"nothing listens on {port}: {self.logs()}") from None
                    time.sleep(0.3)

    def log(self, name: str, chars: int = 3000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {name}\n{self.log(name, chars)}" for name in self.procs)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.hosts.stop()
