"""A real Kubernetes control plane for end-to-end tests, run by kwokctl.

kube-apiserver, kube-controller-manager, kube-scheduler and etcd are the real
binaries of the pinned release, built from source by ``e2e/cluster/build.sh``;
kwok stands in for kubelets (it fakes Node and Pod status) and
``e2e/podrunner.py`` stands in for the container runtime on the GPU node.

Typical use (see e2e/test_cluster_smoke.py)::

    from e2e.cluster import KwokCluster, build_binaries

    bin_dir = build_binaries()                  # cached after the first time
    with KwokCluster(bin_dir=bin_dir) as c:     # create on enter, delete on exit
        kubeconfig = c.kubeconfig               # str path
        c.kubectl("get", "nodes")

Only the standard library plus ``kubernetes`` and ``pyyaml`` are used.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import podnet

E2E_DIR = Path(__file__).resolve().parent
BUILD_SH = E2E_DIR / "cluster" / "build.sh"
STAGES_YAML = E2E_DIR / "kwok-stages.yaml"
WORK_ROOT = E2E_DIR / ".work"  # git-ignored

#: annotation kwok (as configured by kwokctl) requires on the nodes it manages
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
#: label put on every simulated GPU node
GPU_NODE_LABEL = "naiad.e2e/gpu-node"
#: binaries build.sh produces (all are required by KwokCluster except helm/adapter)
BINARIES = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "etcd",
    "etcdctl",
    "kwok",
    "kwokctl",
    "helm",
    "prometheus-adapter",
)


class GoMissing(RuntimeError):
    """No Go toolchain to build the cluster binaries with (tests should skip)."""


class ClusterError(RuntimeError):
    pass


# --------------------------------------------------------------------------- build
def find_go() -> str | None:
    """Path of the go binary build.sh would use, or None."""
    env = os.environ.get("GO")
    if env and os.access(env, os.X_OK):
        return env
    go = shutil.which("go")
    if go:
        return go
    if os.access("/usr/local/go/bin/go", os.X_OK):
        return "/usr/local/go/bin/go"
    return None


def build_binaries(
    *,
    force: bool = False,
    cache_dir: str | os.PathLike | None = None,
    quiet: bool = False,
    timeout: float = 90 * 60,
) -> Path:
    """Run e2e/cluster/build.sh (a no-op when cached) and return the bin dir.

    ``$NAIAD_E2E_BIN`` short-circuits the build: if set, it must point at a dir
    holding all BINARIES.  Raises GoMissing if no Go toolchain is available.
    """
    pre = os.environ.get("NAIAD_E2E_BIN")
    if pre and not force:
        p = Path(pre)
        missing = [b for b in BINARIES if not (p / b).exists()]
        if missing:
            raise ClusterError(f"NAIAD_E2E_BIN={pre} lacks {missing}")
        return p
    go = find_go()
    if go is None:
        raise GoMissing(
            "no Go toolchain (go on PATH or /usr/local/go/bin/go) to build the e2e cluster binaries"
        )
    env = dict(os.environ, GO=go)
    if force:
        env["NAIAD_E2E_FORCE"] = "1"
    if cache_dir is not None:
        env["NAIAD_E2E_CACHE"] = str(cache_dir)
    proc = subprocess.run(
        ["bash", str(BUILD_SH)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise ClusterError(f"build.sh failed with exit code {proc.returncode}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise ClusterError("build.sh printed no bin dir")
    return Path(lines[-1].strip())


def read_versions(bin_dir: str | os.PathLike) -> dict[str, str]:
    """The pinned versions build.sh recorded next to the bin dir (versions.env)."""
    out: dict[str, str] = {}
    f = Path(bin_dir).parent / "versions.env"
    if f.exists():
        for line in f.read_text().splitlines():
            if "=" in line:
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


# --------------------------------------------------------------------------- nodes
@dataclass
class GpuNode:
    """A simulated node for podrunner: kwok manages its status, pods get real processes.

    kwok hands out pod IPs from the node's spec.podCIDR and the pod runner
    binds the real processes to them, so the CIDR must be local to this host.
    It cannot be loopback (127.0.0.0/8): the API server rejects loopback
    addresses in EndpointSlices.  The default is in 198.18.0.0/15 (RFC 2544
    test range) and KwokCluster.create() makes it local with e2e/podnet.py.
    """

    name: str = "gpu-node-0"
    pod_cidr: str = "198.18.0.0/24"
    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict] = field(default_factory=list)
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"

    @property
    def node_ip(self) -> str:
        """The node's InternalIP (= pods' hostIP): the last usable address of pod_cidr,
        so that it is local too and valid wherever the API accepts an IP."""
        import ipaddress

        return str(ipaddress.ip_network(self.pod_cidr).broadcast_address - 1)

    def manifest(self) -> dict:
        alloc = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.pods),
            "nvidia.com/gpu": str(self.gpus),
            "ephemeral-storage": "1Ti",
        }
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            GPU_NODE_LABEL: "true",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.count": str(self.gpus),
            "nvidia.com/gpu.product": self.gpu_product,
        }
        labels.update(self.labels)
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {"podCIDR": self.pod_cidr, "podCIDRs": [self.pod_cidr], "taints": list(self.taints)},
            # kwok's node-initialize stage keeps allocatable/capacity/addresses
            # that are already set
            "status": {
                "allocatable": alloc,
                "capacity": dict(alloc),
                "addresses": [
                    {"type": "InternalIP", "address": self.node_ip},
                    {"type": "Hostname", "address": self.name},
                ],
            },
        }


# --------------------------------------------------------------------------- cluster
class KwokCluster:
    """A kwokctl ``--runtime binary`` cluster made only of locally built binaries.

    Every binary kwokctl could otherwise download (kube-apiserver,
    kube-controller-manager, kube-scheduler, kubectl, etcd, etcdctl, kwok) is
    given explicitly in the generated kwokctl config, and the download prefixes
    point into ``bin_dir`` too, so nothing is fetched.  All state lives in
    ``workdir`` (default: a fresh dir under e2e/.work/); kwokctl's own
    KWOK_WORKDIR is ``workdir/kwok`` so ~/.kwok and ~/.kube are never touched.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        bin_dir: str | os.PathLike | None = None,
        workdir: str | os.PathLike | None = None,
        gpu_nodes: Sequence[GpuNode] | None = None,
        extra_kwokctl_args: Sequence[str] = (),
        keep_workdir: bool | None = None,
        create_timeout: float = 180.0,
        pod_network_mode: str | None = None,
    ) -> None:
        self.name = name or f"naiad-e2e-{uuid.uuid4().hex[:6]}"
        self.bin_dir = Path(bin_dir) if bin_dir is not None else build_binaries()
        self._own_workdir = workdir is None
        if workdir is None:
            WORK_ROOT.mkdir(parents=True, exist_ok=True)
            workdir = tempfile.mkdtemp(prefix=f"{self.name}-", dir=WORK_ROOT)
        self.workdir = Path(workdir).resolve()
        self.gpu_nodes: list[GpuNode] = list(gpu_nodes) if gpu_nodes is not None else [GpuNode()]
        self.extra_kwokctl_args = list(extra_kwokctl_args)
        if keep_workdir is None:
            keep_workdir = os.environ.get("NAIAD_E2E_KEEP") == "1"
        self.keep_workdir = keep_workdir
        self.create_timeout = create_timeout
        self.kubeconfig: str = str(self.workdir / "kubeconfig.yaml")
        self.pod_network_mode: str | None = pod_network_mode
        self.created = False
        self._atexit = None

    # ---------------------------------------------------------------- paths
    def bin(self, name: str) -> str:
        return str(self.bin_dir / name)

    @property
    def kwok_workdir(self) -> Path:
        return self.workdir / "kwok"

    @property
    def cluster_dir(self) -> Path:
        """kwokctl's dir for this cluster (component logs are in ``logs/``)."""
        return self.kwok_workdir / "clusters" / self.name

    @property
    def runner_node_names(self) -> list[str]:
        return [n.name for n in self.gpu_nodes]

    @property
    def versions(self) -> dict[str, str]:
        return read_versions(self.bin_dir)

    def env(self) -> dict[str, str]:
        """Environment for kwokctl/kubectl/helm aimed at this cluster only."""
        return dict(
            os.environ,
            KWOK_WORKDIR=str(self.kwok_workdir),
            KUBECONFIG=self.kubeconfig,
            KUBECACHEDIR=str(self.workdir / "kube-cache"),  # not ~/.kube/cache
            HELM_CACHE_HOME=str(self.workdir / "helm" / "cache"),
            HELM_CONFIG_HOME=str(self.workdir / "helm" / "config"),
            HELM_DATA_HOME=str(self.workdir / "helm" / "data"),
        )

    # ---------------------------------------------------------------- config
    def kwokctl_config(self) -> list[dict]:
        b = self.bin
        conf = {
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
            "kind": "KwokctlConfiguration",
            "options": {
                "runtime": "binary",
                "kubeApiserverBinary": b("kube-apiserver"),
                "kubeControllerManagerBinary": b("kube-controller-manager"),
                "kubeSchedulerBinary": b("kube-scheduler"),
                "kubectlBinary": b("kubectl"),
                "etcdBinary": b("etcd"),
                "etcdctlBinary": b("etcdctl"),
                "kwokControllerBinary": b("kwok"),
                # anything not listed above would resolve inside bin_dir (and
                # fail loudly) instead of being downloaded
                "kubeBinaryPrefix": str(self.bin_dir),
                "kwokBinaryPrefix": str(self.bin_dir),
                "etcdBinaryPrefix": str(self.bin_dir),
                "cacheDir": str(self.workdir / "kwok-cache"),
                "quietPull": True,
                # pods on a real node (e2e/node) reach the API server through the "kubernetes" Service's
                # ClusterIP (the default range's first address) and verify its certificate against that IP
                "kubeApiserverCertSANs": ["10.0.0.1"],
            },
            # kwokctl starts kwok with --manage-all-nodes=true: kwok would then also fake the status of a real
            # kubelet's node (e2e/node) and of its pods; limit it to the nodes that carry its annotation
            "componentsPatches": [
                {
                    "name": "kwok-controller",
                    "extraArgs": [
                        {"key": "manage-all-nodes", "value": "false"},
                        {
                            "key": "manage-nodes-with-annotation-selector",
                            "value": f"{KWOK_NODE_ANNOTATION}=fake",
                        },
                    ],
                }
            ],
        }
        stages = [d for d in yaml.safe_load_all(STAGES_YAML.read_text()) if d]
        for st in stages:
            op = (st.get("metadata", {}).get("annotations") or {}).get("naiad.e2e/runner-nodes")
            if op:
                exprs = st["spec"]["selector"].setdefault("matchExpressions", [])
                exprs.append({"key": ".spec.nodeName", "operator": op, "values": self.runner_node_names})
        return [conf, *stages]

    # ---------------------------------------------------------------- commands
    def kwokctl(
        self, *args: str, check: bool = True, timeout: float | None = None, capture: bool = True
    ) -> subprocess.CompletedProcess:
        return self._run(
            [self.bin("kwokctl"), "--name", self.name, *args], check=check, timeout=timeout, capture=capture
        )

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        timeout: float | None = 120,
        input: str | None = None,
        capture: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run the cluster's kubectl (text mode); returns CompletedProcess."""
        return self._run(
            [self.bin("kubectl"), "--kubeconfig", self.kubeconfig, *args],
            check=check,
            timeout=timeout,
            input=input,
            capture=capture,
        )

    def helm(
        self, *args: str, check: bool = True, timeout: float | None = 300
    ) -> subprocess.CompletedProcess:
        return self._run(
            [self.bin("helm"), "--kubeconfig", self.kubeconfig, *args], check=check, timeout=timeout
        )

    def apply(self, manifest: dict | list | str) -> subprocess.CompletedProcess:
        """``kubectl apply -f -`` for a dict, a list of dicts or YAML text."""
        if isinstance(manifest, dict):
            text = yaml.safe_dump(manifest)
        elif isinstance(manifest, list):
            text = yaml.safe_dump_all(manifest)
        else:
            text = manifest
        return self.kubectl("apply", "-f", "-", input=text)

    def _run(
        self,
        argv: list[str],
        *,
        check: bool,
        timeout: float | None,
        input: str | None = None,
        capture: bool = True,
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            argv,
            env=self.env(),
            input=input,
            text=True,
            timeout=timeout,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.PIPE if capture else None,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def api_client(self):
        """A kubernetes.client.ApiClient for this cluster (new one per call)."""
        from kubernetes import config as kconfig

        return kconfig.new_client_from_config(config_file=self.kubeconfig)

    # ---------------------------------------------------------------- lifecycle
    def create(self) -> str:
        """Create the cluster and GPU node(s); return the kubeconfig path."""
        if self.created:
            return self.kubeconfig
        missing = [
            b
            for b in (
                "kube-apiserver",
                "kube-controller-manager",
                "kube-scheduler",
                "kubectl",
                "etcd",
                "etcdctl",
                "kwok",
                "kwokctl",
            )
            if not os.access(self.bin(b), os.X_OK)
        ]
        if missing:
            raise ClusterError(f"{self.bin_dir} lacks {missing}; run e2e/cluster/build.sh")
        # before any component starts: in "netns" mode this process (and so
        # everything it starts from now on) moves into a private network namespace
        self.pod_network_mode = podnet.ensure_pod_network(
            [n.pod_cidr for n in self.gpu_nodes], self.pod_network_mode
        )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kwok_workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "kwokctl.yaml"
        cfg.write_text(yaml.safe_dump_all(self.kwokctl_config(), sort_keys=False))
        self._atexit = atexit.register(self._atexit_delete)
        self.created = True  # from here on delete() has something to clean up
        t = int(self.create_timeout)
        extra = list(self.extra_kwokctl_args)
        if not any("advertise-address" in a for a in extra):
            # kube-apiserver picks its advertise address from the default route;
            # there is none in a private network namespace, and loopback is not
            # a valid endpoint for the "kubernetes" Service.  Use the node IP.
            extra += ["--extra-args", f"kube-apiserver=advertise-address={self.gpu_nodes[0].node_ip}"]
        if not any("kubelet-preferred-address-types" in a for a in extra):
            # a real kubelet (e2e/node) is reached for logs/exec at its node IP: there is no DNS for node names
            extra += ["--extra-args", "kube-apiserver=kubelet-preferred-address-types=InternalIP,Hostname"]
        if not any("enable-aggregator-routing" in a for a in extra):
            # no kube-proxy: aggregated APIs (e.g. prometheus-adapter, see
            # monitoring.py) must be reached at endpoint IPs, not ClusterIPs
            extra += ["--extra-args", "kube-apiserver=enable-aggregator-routing=true"]
        try:
            proc = self.kwokctl(
                "create",
                "cluster",
                "--runtime",
                "binary",
                "--config",
                str(cfg),
                "--kubeconfig",
                self.kubeconfig,
                "--wait",
                f"{t}s",
                "--timeout",
                f"{t}s",
                *extra,
                check=False,
                timeout=self.create_timeout + 60,
            )
        except subprocess.TimeoutExpired as e:
            proc = subprocess.CompletedProcess(e.cmd, -9, e.stdout or "", e.stderr or "")
        if proc.returncode != 0:
            logs = self.component_logs_tail()
            self.delete()
            raise ClusterError(
                f"kwokctl create cluster failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}\n{logs}"
            )
        self._wait_api()
        for node in self.gpu_nodes:
            self.add_node(node)
        self._wait_default_serviceaccount()
        return self.kubeconfig

    def add_node(self, node: GpuNode, timeout: float = 60) -> None:
        """Create a kwok-managed node and wait until kwok reports it Ready.

        Pods on nodes added after create() are handled by kwok's stock stages
        (not by the pod runner) unless the node was also passed in gpu_nodes.
        """
        self.apply(node.manifest())
        deadline = time.monotonic() + timeout
        while True:
            out = self.kubectl("get", "node", node.name, "-o", "json", check=False)
            if out.returncode == 0:
                st = json.loads(out.stdout).get("status", {})
                ready = [c for c in st.get("conditions", []) if c.get("type") == "Ready"]
                if ready and ready[0].get("status") == "True":
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"node {node.name} not Ready after {timeout}s: {out.stdout}{out.stderr}")
            time.sleep(0.5)

    def _wait_api(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            p = self.kubectl("get", "--raw", "/readyz", check=False, timeout=20)
            if p.returncode == 0 and p.stdout.strip() == "ok":
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"apiserver not ready: {p.stdout}{p.stderr}")
            time.sleep(0.5)

    def _wait_default_serviceaccount(self, timeout: float = 60) -> None:
        # pods cannot be created in a namespace until kube-controller-manager
        # has made its "default" ServiceAccount
        deadline = time.monotonic() + timeout
        while self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise ClusterError(
                    "ServiceAccount default/default never appeared (kube-controller-manager down?)"
                )
            time.sleep(0.5)

    def component_logs_tail(self, lines: int = 40) -> str:
        """Tail of each component's log (for error messages)."""
        out = []
        logdir = self.cluster_dir / "logs"
        if logdir.is_dir():
            for f in sorted(logdir.glob("*.log")):
                try:
                    tail = f.read_text(errors="replace").splitlines()[-lines:]
                except OSError:
                    continue
                out.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def delete(self) -> None:
        """Stop all components and remove the work dir (unless keep_workdir)."""
        if not self.created:
            if self._own_workdir and not self.keep_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            return
        self.created = False
        if self._atexit is not None:
            atexit.unregister(self._atexit_delete)
            self._atexit = None
        if self.keep_workdir and (self.cluster_dir / "logs").is_dir():
            # kwokctl removes its cluster dir; keep the component logs for debugging
            shutil.copytree(self.cluster_dir / "logs", self.workdir / "component-logs", dirs_exist_ok=True)
        try:
            self.kwokctl("delete", "cluster", check=False, timeout=120)
        finally:
            if self.pod_network_mode == "host-route":
                podnet.remove_routes([n.pod_cidr for n in self.gpu_nodes])
            if not self.keep_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def _atexit_delete(self) -> None:
        try:
            self.delete()
        except Exception as e:  # pragma: no cover - best effort at interpreter exit
            print(f"naiad e2e: failed to delete cluster {self.name}: {e}", file=sys.stderr)

    def __enter__(self) -> KwokCluster:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.delete()


def create_cluster(**kwargs) -> KwokCluster:
    """Build (or reuse) the binaries, create a KwokCluster and return it (caller deletes)."""
    c = KwokCluster(**kwargs)
    c.create()
    return c
