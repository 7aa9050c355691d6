"""Start and stop one real node -- containerd, kubelet, kube-proxy and a test GPU device plugin -- for a KwokCluster.

The node's processes share the test's pod network namespace (e2e/podnet.py) and get a mount namespace of their
own, held by a ``sleep`` process, with tmpfs over the paths containerd, CNI and the kubelet hard-code
(/run/containerd, /run/netns, /var/lib/cni, /var/lib/kubelet, /var/log/pods, /var/log/containers): every mount
they make (overlay roots, pod volumes, network namespace files) disappears with that namespace, so nothing is left
mounted on the host. Every process, the pods included, lives under one cgroup per hierarchy (e2e/node/cgroups.py),
which ``stop()`` empties and removes. Kernel tunables the kubelet insists on setting are restored on stop.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import yaml

from .. import podnet
from ..cluster import E2E_DIR, KwokCluster
from . import cgroups, config
from .pause import PAUSE_IMAGE, write_pause_archive

TOOLS_BUILD = E2E_DIR.parent / "tools" / "go" / "build.sh"
#: paths the node's mount namespace covers with a tmpfs of its own
PRIVATE_DIRS = (
    config.CONTAINERD_STATE,
    "/run/netns",
    "/var/lib/cni",
    config.KUBELET_ROOT,
    "/var/log/pods",
    "/var/log/containers",
)
#: the sysctls the kubelet sets (KernelTunableModify); restored on stop
KERNEL_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
#: taint on the real node so pods of other tests stay on kwok's nodes
REAL_NODE_TAINT = {"key": "naiad.e2e/real-node", "value": "true", "effect": "NoSchedule"}
REAL_NODE_TOLERATION = {"key": "naiad.e2e/real-node", "operator": "Exists", "effect": "NoSchedule"}


class NodeError(RuntimeError):
    """The real node could not be started (a missing tool, a component that exited or never became Ready)."""


def missing_requirements() -> str | None:
    """Why a real node cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "a real node needs root (containerd, runc, cgroups, mounts)"
    for tool in ("containerd", "runc", "ctr", "unshare", "nsenter", "iptables", "ip"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"{tool} not found (apt-get install containerd runc containernetworking-plugins iptables)"
    for plugin in ("bridge", "host-local", "loopback", "portmap"):
        if not Path(config.CNI_BIN_DIR, plugin).exists():
            return f"CNI plugin {plugin} not in {config.CNI_BIN_DIR} (apt-get install containernetworking-plugins)"
    return None


def build_node_tools() -> Path:
    """Build (or reuse) tools/go/e2e-node: the GPU device plugin and the pause binary; return their bin dir."""
    out = subprocess.run(
        ["bash", str(TOOLS_BUILD), "e2e-node"], stdout=subprocess.PIPE, text=True, check=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


class RealNode:
    """One real node registered with ``cluster``'s API server (see the module docstring)."""

    def __init__(
        self,
        cluster: KwokCluster,
        *,
        name: str = "real-node-0",
        pod_cidr: str = "198.19.1.0/24",
        node_ip: str = "198.19.0.1",
        service_cidr: str = "10.0.0.0/24",
        images: Sequence[Path] = (),
        tools_dir: Path | None = None,
        gpus: int = 8,
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.pod_cidr = pod_cidr
        self.node_ip = node_ip
        self.service_cidr = service_cidr
        self.images = [Path(p) for p in images]
        self.tools_dir = tools_dir
        self.gpus = gpus
        self.workdir = cluster.workdir / "node" / name
        self.cgroup = f"naiad-e2e-{name}-{uuid.uuid4().hex[:6]}"
        self.procs: dict[str, subprocess.Popen] = {}
        self._cgroup_procs: list[Path] = []
        self._tunables: dict[str, str] = {}
        self._created_dirs: list[str] = []
        self._node_ip_added = False
        self._service_route_added = False
        self.started = False

    # ------------------------------------------------------------------ helpers
    def bin(self, name: str) -> str:
        return self.cluster.bin(name)

    def log(self, component: str) -> Path:
        return self.workdir / "logs" / f"{component}.log"

    def _spawn(self, component: str, argv: Sequence[str], *, in_mount_ns: bool = True) -> subprocess.Popen:
        """Start argv in the node's cgroups (and mount namespace), output to logs/<component>.log."""
        prelude = (
            'for f in "$@"; do case "$f" in --) shift; break;; esac; echo $$ > "$f"; shift; done; exec "$@"'
        )
        ns = ["nsenter", "-t", str(self.procs["mountns"].pid), "-m", "--"] if in_mount_ns else []
        full = ["sh", "-c", prelude, "sh", *map(str, self._cgroup_procs), "--", *ns, *argv]
        self.log(component).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log(component), "ab") as out:
            p = subprocess.Popen(
                full, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.procs[component] = p
        return p

    def ns_run(self, *argv: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside the node's mount namespace (e.g. ``ctr``), capturing its output."""
        p = subprocess.run(
            ["nsenter", "-t", str(self.procs["mountns"].pid), "-m", "--", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and p.returncode != 0:
            raise NodeError(f"{shlex.join(argv)} failed ({p.returncode}): {p.stdout}{p.stderr}")
        return p

    def ctr(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.ns_run("ctr", "-a", config.CONTAINERD_SOCK, "-n", "k8s.io", *args, timeout=timeout)

    def _check_alive(self) -> None:
        for comp, p in self.procs.items():
            if p.poll() is not None:
                tail = self.log(comp).read_text(errors="replace")[-3000:] if self.log(comp).exists() else ""
                raise NodeError(f"{comp} exited ({p.returncode}):\n{tail}")

    def _wait(self, what: str, cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            self._check_alive()
            if time.monotonic() > deadline:
                raise NodeError(f"{what} not reached after {timeout:.0f}s")
            time.sleep(0.5)

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 300) -> RealNode:
        """Start every component, import the images and wait until the node is Ready with its GPUs advertised."""
        why = missing_requirements()
        if why:
            raise NodeError(why)
        for b in ("kubelet", "kube-proxy"):
            if not os.access(self.bin(b), os.X_OK):
                raise NodeError(f"{self.bin(b)} missing: run e2e/cluster/build.sh")
        tools = self.tools_dir or build_node_tools()
        self.started = True
        try:
            self._start(tools, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, tools: Path, timeout: float) -> None:
        w = self.workdir
        for d in ("logs", "containerd", "cni/net.d", "cni/ipam", "images"):
            (w / d).mkdir(parents=True, exist_ok=True)
        self._cgroup_procs = cgroups.create(self.cgroup, "node")
        for t in KERNEL_TUNABLES:
            self._tunables[t] = Path("/proc/sys", t).read_text().strip()
        if not podnet.bindable(self.node_ip):
            subprocess.run(["ip", "addr", "add", f"{self.node_ip}/32", "dev", "lo"], check=True)
            self._node_ip_added = True
        if not _has_route(self.service_cidr):
            # the pod network's namespace has no default route: without one to the Service range a connect() to a
            # ClusterIP fails before kube-proxy's OUTPUT rules could rewrite it to a pod IP
            subprocess.run(
                ["ip", "route", "add", self.service_cidr, "dev", "lo", "src", self.node_ip], check=True
            )
            self._service_route_added = True
        for d in PRIVATE_DIRS:
            if not os.path.isdir(d):
                os.makedirs(d)
                self._created_dirs.append(d)
        ready = w / "mountns.ready"
        mounts = "; ".join(f"mount -t tmpfs -o mode=0755 naiad-e2e-node {d}" for d in PRIVATE_DIRS)
        script = f"set -e; mount --make-rprivate /; {mounts}; mount --make-rshared /; touch {ready}; exec sleep infinity"
        self._spawn(
            "mountns",
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
            in_mount_ns=False,
        )
        self._wait("node mount namespace", ready.exists, 30)

        (w / "cni/net.d/10-naiad-e2e.conflist").write_text(config.cni_conflist(self.pod_cidr, w / "cni/ipam"))
        (w / "containerd/config.toml").write_text(
            config.containerd_toml(w / "containerd/root", w / "cni/net.d", PAUSE_IMAGE)
        )
        self._spawn("containerd", ["containerd", "--config", str(w / "containerd/config.toml")])
        self._wait(
            "containerd socket",
            lambda: (
                self.ns_run(
                    "ctr", "-a", config.CONTAINERD_SOCK, "version", check=False, timeout=30
                ).returncode
                == 0
            ),
            60,
        )
        archives = [write_pause_archive(tools / "pause", w / "images/pause.tar"), *self.images]
        for a in archives:
            self.ctr("images", "import", str(a))

        v1 = cgroups.cgroup_version() == 1
        kcfg = config.kubelet_config(node_ip=self.node_ip, cgroup_root=f"/{self.cgroup}", cgroup_v1=v1)
        kcfg["registerWithTaints"] = [REAL_NODE_TAINT]
        (w / "kubelet.yaml").write_text(yaml.safe_dump(kcfg))
        labels = f"naiad.e2e/real-node=true,nvidia.com/gpu.present=true,nvidia.com/gpu.count={self.gpus}"
        self._spawn(
            "kubelet",
            [
                self.bin("kubelet"),
                f"--config={w / 'kubelet.yaml'}",
                f"--kubeconfig={self.cluster.kubeconfig}",
                f"--root-dir={config.KUBELET_ROOT}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.node_ip}",
                f"--node-labels={labels}",
                "--v=2",
            ],
        )
        self._spawn(
            "gpu-device-plugin",
            [
                str(tools / "gpu-device-plugin"),
                f"-device-plugin-dir={config.KUBELET_ROOT}/device-plugins",
                f"-count={self.gpus}",
            ],
        )
        kp = config.kube_proxy_config(
            kubeconfig=self.cluster.kubeconfig,
            node_name=self.name,
            node_ip=self.node_ip,
            pod_cidr=self.pod_cidr,
        )
        (w / "kube-proxy.yaml").write_text(yaml.safe_dump(kp))
        self._spawn("kube-proxy", [self.bin("kube-proxy"), f"--config={w / 'kube-proxy.yaml'}", "--v=2"])
        self._wait("node Ready with nvidia.com/gpu allocatable", self._ready, timeout)

    def node_object(self) -> dict | None:
        p = self.cluster.kubectl("get", "node", self.name, "-o", "json", check=False, timeout=30)
        return json.loads(p.stdout) if p.returncode == 0 else None

    def _ready(self) -> bool:
        node = self.node_object()
        if not node:
            return False
        st = node.get("status", {})
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions", []))
        return ready and st.get("allocatable", {}).get("nvidia.com/gpu") == str(self.gpus)

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Delete the node's pods, stop every component, and remove what the node added to the host."""
        if not self.started:
            return
        self.started = False
        errors: list[str] = []

        def attempt(what: str, fn) -> None:
            try:
                fn()
            except Exception as e:  # keep tearing down; report at the end
                errors.append(f"{what}: {e}")

        kubelet = self.procs.get("kubelet")
        if kubelet is not None and kubelet.poll() is None:
            # while the kubelet runs, deleting the pods makes it stop them and CNI release their addresses
            attempt(
                "delete pods",
                lambda: self.cluster.kubectl(
                    "delete",
                    "pods",
                    "-A",
                    f"--field-selector=spec.nodeName={self.name}",
                    "--grace-period=5",
                    "--timeout=60s",
                    check=False,
                    timeout=90,
                ),
            )
        for comp in ("kube-proxy", "gpu-device-plugin", "kubelet", "containerd"):
            p = self.procs.get(comp)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
        attempt(
            "kube-proxy --cleanup",
            lambda: subprocess.run([self.bin("kube-proxy"), "--cleanup"], capture_output=True, timeout=60),
        )
        attempt("kill node processes", lambda: cgroups.kill_all(self.cgroup))
        for p in self.procs.values():
            attempt("reap", lambda p=p: p.wait(10))
        attempt("remove cgroups", lambda: cgroups.remove(self.cgroup))
        attempt("CNI iptables rules", remove_cni_rules)
        subprocess.run(["ip", "link", "del", config.BRIDGE], capture_output=True)
        if self._service_route_added:
            attempt(
                "service route",
                lambda: subprocess.run(
                    ["ip", "route", "del", self.service_cidr, "dev", "lo"], check=True, capture_output=True
                ),
            )
        if self._node_ip_added:
            attempt(
                "node IP",
                lambda: subprocess.run(
                    ["ip", "addr", "del", f"{self.node_ip}/32", "dev", "lo"], check=True, capture_output=True
                ),
            )
        for t, v in self._tunables.items():
            attempt(f"sysctl {t}", lambda t=t, v=v: Path("/proc/sys", t).write_text(v))
        for d in reversed(self._created_dirs):
            attempt(f"rmdir {d}", lambda d=d: os.rmdir(d))
        attempt(
            "delete node",
            lambda: self.cluster.kubectl(
                "delete", "node", self.name, "--wait=false", check=False, timeout=30
            ),
        )
        if errors:
            raise NodeError("stopping the real node: " + "; ".join(errors))

    def __enter__(self) -> RealNode:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _has_route(cidr: str) -> bool:
    """Whether any route (a default route included) leads to the range's first address."""
    out = subprocess.run(["ip", "route", "show", "match", cidr.split("/")[0]], capture_output=True, text=True)
    return bool(out.stdout.strip())


def remove_cni_rules() -> None:
    """Delete iptables rules and chains the CNI bridge/portmap plugins left (names start with ``CNI-``)."""
    for table in ("nat", "filter"):
        rules = subprocess.run(
            ["iptables", "-t", table, "-S"], capture_output=True, text=True
        ).stdout.splitlines()
        for r in rules:
            if r.startswith("-A ") and "CNI-" in r and not r.split()[1].startswith("CNI-"):
                subprocess.run(
                    ["iptables", "-t", table, *shlex.split(r.replace("-A ", "-D ", 1))], capture_output=True
                )
        chains = [r.split()[1] for r in rules if r.startswith("-N CNI-")]
        for c in chains:
            subprocess.run(["iptables", "-t", table, "-F", c], capture_output=True)
        for c in chains:
            subprocess.run(["iptables", "-t", table, "-X", c], capture_output=True)
