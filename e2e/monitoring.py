"""Prometheus + prometheus-adapter for e2e tests (custom metrics / HPA).

* ``Prometheus`` runs Debian's ``prometheus`` binary (``apt-get install
  prometheus``; not as a service) with a generated config.  It scrapes given
  static targets and, when given a kubeconfig, discovers pods through the
  cluster's API: pods that are Running with an IP and either annotated
  ``prometheus.io/scrape: "true"`` (optional ``prometheus.io/port`` /
  ``prometheus.io/path``) or that declare a container port named ``metrics``.
  Debian builds prometheus without kubernetes_sd_configs, so a small thread
  here lists pods every second and writes a file_sd_configs file (prometheus
  picks up changes itself).  Targets carry ``namespace``, ``pod`` and ``node``
  labels, which is what prometheus-adapter needs to attach series to pods.
* ``PrometheusAdapter`` runs the locally built adapter (e2e/cluster/build.sh)
  as an aggregated API server and registers it in the cluster as
  ``v1beta1.custom.metrics.k8s.io`` (APIService -> selector-less Service ->
  hand-made EndpointSlice with the adapter's host address; kube-apiserver runs
  with --enable-aggregator-routing, see cluster.py).  The kube-controller-manager
  HPA controller then reads custom metrics through it exactly as in a real
  cluster.

Both need the pod network of e2e/podnet.py (they run in the same network
namespace as the cluster), so create them after KwokCluster.create().
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from .cluster import WORK_ROOT, KwokCluster


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_prometheus() -> str | None:
    """Path of Debian's prometheus binary (or $NAIAD_E2E_PROMETHEUS), or None."""
    env = os.environ.get("NAIAD_E2E_PROMETHEUS")
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
    )


def pod_targets(pods: Sequence[dict]) -> list[dict]:
    """file_sd target groups for pods to scrape (same rules as the usual
    kubernetes-pods job: annotation prometheus.io/scrape=true, else a
    container port named "metrics")."""
    groups = []
    for pod in pods:
        meta, spec, st = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
        if st.get("phase") != "Running" or not st.get("podIP") or meta.get("deletionTimestamp"):
            continue
        ann = meta.get("annotations") or {}
        path = ann.get("prometheus.io/path", "/metrics")
        ports: list[int] = []
        if ann.get("prometheus.io/scrape") == "true":
            if ann.get("prometheus.io/port"):
                ports = [int(ann["prometheus.io/port"])]
            else:
                ports = [
                    p["containerPort"] for c in spec.get("containers", []) for p in c.get("ports") or []
                ][:1]
        else:
            ports = [
                p["containerPort"]
                for c in spec.get("containers", [])
                for p in c.get("ports") or []
                if p.get("name") == "metrics"
            ]
        for port in ports:
            groups.append(
                {
                    "targets": [f"{st['podIP']}:{port}"],
                    "labels": {
                        "namespace": meta["namespace"],
                        "pod": meta["name"],
                        "node": spec.get("nodeName", ""),
                        "__metrics_path__": path,
                    },
                }
            )
    return groups


class Prometheus:
    """Debian's prometheus, run directly with a generated config."""

    def __init__(
        self,
        *,
        kubeconfig: str | None = None,
        static_targets: Sequence[str] = (),
        scrape_interval: str = "1s",
        extra_scrape_configs: Sequence[dict] = (),
        binary: str | None = None,
        workdir: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.binary = binary or find_prometheus()
        if not self.binary:
            raise FileNotFoundError("prometheus binary not found (apt-get install prometheus)")
        self.kubeconfig = kubeconfig
        self.static_targets = list(static_targets)
        self.scrape_interval = scrape_interval
        self.extra_scrape_configs = list(extra_scrape_configs)
        self._own_workdir = workdir is None
        if workdir is None:
            WORK_ROOT.mkdir(parents=True, exist_ok=True)
            workdir = tempfile.mkdtemp(prefix="prometheus-", dir=WORK_ROOT)
        self.workdir = Path(workdir).resolve()
        self.host = host
        self.port = port or free_port(host)
        self.proc: subprocess.Popen | None = None
        self.discovery_interval = 1.0
        self._api = None
        self._last_sd: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    @property
    def sd_file(self) -> Path:
        return self.workdir / "pods.json"

    def _discover_once(self) -> None:
        pods = self._api.get_json("/api/v1/pods").get("items", [])
        data = json.dumps(pod_targets(pods), sort_keys=True)
        if data != self._last_sd:
            tmp = self.sd_file.with_suffix(".tmp")
            tmp.write_text(data)
            os.replace(tmp, self.sd_file)
            self._last_sd = data

    def _discover_loop(self) -> None:
        while not self._stop.wait(self.discovery_interval):
            try:
                self._discover_once()
            except Exception:  # API hiccup: next round
                pass

    def config(self) -> dict:
        scrape = []
        if self.static_targets:
            scrape.append(
                {
                    "job_name": "static",
                    "scrape_interval": self.scrape_interval,
                    "scrape_timeout": self.scrape_interval,
                    "static_configs": [{"targets": self.static_targets}],
                }
            )
        if self.kubeconfig:
            scrape.append(
                {
                    "job_name": "kubernetes-pods",
                    "scrape_interval": self.scrape_interval,
                    "scrape_timeout": self.scrape_interval,
                    "file_sd_configs": [{"files": [str(self.sd_file)], "refresh_interval": "1s"}],
                }
            )
        scrape += self.extra_scrape_configs
        return {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": scrape,
        }

    def start(self, timeout: float = 60) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        if self.kubeconfig:
            from .podrunner import _Api

            self._api = _Api(self.kubeconfig)
            self.sd_file.write_text("[]")
            self._discover_once()
            self._stop.clear()
            self._thread = threading.Thread(target=self._discover_loop, name="prometheus-pod-sd", daemon=True)
            self._thread.start()
        argv = [
            self.binary,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address={self.host}:{self.port}",
            "--web.enable-lifecycle",
            "--storage.tsdb.retention.time=1d",
            "--log.level=info",
        ]
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.3)

    def reload(self, static_targets: Sequence[str] | None = None) -> None:
        """Rewrite the config (e.g. new static targets) and hot-reload it."""
        if static_targets is not None:
            self.static_targets = list(static_targets)
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(self.config(), sort_keys=False))
        req = urllib.request.Request(self.url + "/-/reload", method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    def api(self, path: str, **params) -> dict:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """Instant query; returns data.result."""
        return self.api("query", query=promql)["result"]

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def wait_for(self, promql: str, timeout: float = 60, min_results: int = 1) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            res = self.query(promql)
            if len(res) >= min_results:
                return res
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result for {promql!r} after {timeout}s; targets: {self.targets()}")
            time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._own_workdir and os.environ.get("NAIAD_E2E_KEEP") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


#: default adapter rules: every pod series as a pods/<name> custom metric;
#: counters ("*_total") as per-second rates named "<name without _total>_per_second"
DEFAULT_ADAPTER_RULES: dict = {
    "rules": [
        {
            "seriesQuery": '{namespace!="",pod!="",__name__=~".*_total$"}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
            "name": {"matches": "^(.*)_total$", "as": "${1}_per_second"},
            "metricsQuery": "sum(rate(<<.Series>>{<<.LabelMatchers>>}[30s])) by (<<.GroupBy>>)",
        },
        {
            "seriesQuery": '{namespace!="",pod!="",__name__!~".*_total$"}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
            "name": {"matches": "^(.*)$", "as": "${1}"},
            "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
        },
    ]
}


class PrometheusAdapter:
    """sigs.k8s.io/prometheus-adapter serving custom.metrics.k8s.io for the cluster."""

    API_GROUP = "custom.metrics.k8s.io"
    API_VERSION = "v1beta1"

    def __init__(
        self,
        cluster: KwokCluster,
        prometheus_url: str,
        *,
        rules: Mapping | None = None,
        namespace: str = "monitoring",
        name: str = "prometheus-adapter",
        relist_interval: str = "5s",
        workdir: str | os.PathLike | None = None,
        host: str | None = None,
        port: int | None = None,
    ) -> None:
        self.cluster = cluster
        self.prometheus_url = prometheus_url
        self.rules = dict(rules or DEFAULT_ADAPTER_RULES)
        self.namespace = namespace
        self.name = name
        self.relist_interval = relist_interval
        self._own_workdir = workdir is None
        if workdir is None:
            WORK_ROOT.mkdir(parents=True, exist_ok=True)
            workdir = tempfile.mkdtemp(prefix="prometheus-adapter-", dir=WORK_ROOT)
        self.workdir = Path(workdir).resolve()
        # an EndpointSlice address must not be loopback: bind to the node IP
        self.host = host or cluster.gpu_nodes[0].node_ip
        self.port = port or free_port(self.host)
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / "adapter.log"

    @property
    def apiservice_name(self) -> str:
        return f"{self.API_VERSION}.{self.API_GROUP}"

    def manifests(self) -> list[dict]:
        return [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}},
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"ports": [{"name": "https", "port": 443, "targetPort": self.port}]},
            },
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": self.name,
                    "namespace": self.namespace,
                    "labels": {
                        "kubernetes.io/service-name": self.name,
                        "endpointslice.kubernetes.io/managed-by": "naiad-e2e",
                    },
                },
                "addressType": "IPv4",
                "endpoints": [{"addresses": [self.host], "conditions": {"ready": True}}],
                "ports": [{"name": "https", "port": self.port, "protocol": "TCP"}],
            },
            {
                "apiVersion": "apiregistration.k8s.io/v1",
                "kind": "APIService",
                "metadata": {"name": self.apiservice_name},
                "spec": {
                    "service": {"name": self.name, "namespace": self.namespace, "port": 443},
                    "group": self.API_GROUP,
                    "version": self.API_VERSION,
                    "insecureSkipTLSVerify": True,
                    "groupPriorityMinimum": 100,
                    "versionPriority": 100,
                },
            },
        ]

    def start(self, timeout: float = 120) -> PrometheusAdapter:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "certs").mkdir(exist_ok=True)
        cfg = self.workdir / "config.yaml"
        cfg.write_text(yaml.safe_dump(self.rules, sort_keys=False))
        kc = self.cluster.kubeconfig
        argv = [
            self.cluster.bin("prometheus-adapter"),
            f"--lister-kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            f"--prometheus-url={self.prometheus_url}",
            f"--metrics-relist-interval={self.relist_interval}",
            f"--config={cfg}",
            f"--secure-port={self.port}",
            f"--bind-address={self.host}",
            f"--cert-dir={self.workdir / 'certs'}",
            "--v=2",
        ]
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.cluster.apply(self.manifests())
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus-adapter exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            p = self.cluster.kubectl(
                "get", "--raw", f"/apis/{self.API_GROUP}/{self.API_VERSION}", check=False
            )
            if p.returncode == 0:
                return self
            if time.monotonic() > deadline:
                st = self.cluster.kubectl(
                    "get", "apiservice", self.apiservice_name, "-o", "yaml", check=False
                )
                raise TimeoutError(
                    f"custom metrics API not available: {p.stderr}\n{st.stdout}\n"
                    f"{self.log_path.read_text()[-3000:]}"
                )
            time.sleep(0.5)

    def pod_metric(self, namespace: str, metric: str, pod: str = "*") -> list[dict]:
        """Values of a pods/<metric> custom metric, as the HPA controller reads them."""
        p = self.cluster.kubectl(
            "get",
            "--raw",
            f"/apis/{self.API_GROUP}/{self.API_VERSION}/namespaces/{namespace}/pods/{pod}/{metric}",
            check=False,
        )
        if p.returncode != 0:
            return []
        return json.loads(p.stdout).get("items", [])

    def wait_for_pod_metric(
        self, namespace: str, metric: str, timeout: float = 90, min_items: int = 1
    ) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            items = self.pod_metric(namespace, metric)
            if len(items) >= min_items:
                return items
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"custom metric pods/{metric} in {namespace} not available after {timeout}s"
                )
            time.sleep(1)

    def stop(self) -> None:
        if self.cluster.created:
            self.cluster.kubectl(
                "delete", "apiservice", self.apiservice_name, "--ignore-not-found", check=False
            )
            self.cluster.kubectl(
                "delete",
                "service,endpointslice",
                self.name,
                "-n",
                self.namespace,
                "--ignore-not-found",
                check=False,
            )
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._own_workdir and os.environ.get("NAIAD_E2E_KEEP") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PrometheusAdapter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
