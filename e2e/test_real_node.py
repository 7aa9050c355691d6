"""The real node (e2e/node): a Naiad server pod from the built image, run by the real kubelet and containerd.

The server image is imported into containerd (``ctr images import``), the pod asks for ``nvidia.com/gpu: 1`` from
the test device plugin, passes its readinessProbe through the kubelet, answers an inference request through its
ClusterIP Service (kube-proxy's iptables rules), ``kubectl logs`` shows Triton's log layout, and a killed container
is restarted by the kubelet. Busy polling is measured under CPU quotas. The operator, installed with helm, runs its
pools there: a load that OOM-kills the server shows on the InferenceModel's status, and a rolling update under
traffic from a client pod (through the model's ClusterIP Service) fails no request.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from e2e.cluster import KwokCluster
from e2e.images import DEFAULT_ARCHIVES
from e2e.node import RealNode
from e2e.node.node import REAL_NODE_TOLERATION, missing_requirements
from e2e.node.traffic import client_pod, client_summary, concurrent_load

ROOT = Path(__file__).resolve().parents[1]
NS = "real-node"
APP = "naiad-server"
#: glog's layout, as Triton (and Naiad's default --log-format) writes it
TRITON_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w./-]+:\d+\] ", re.M)


def _server_archive() -> tuple[Path, str]:
    """The server image's docker-archive and name, from ``make images``' digest file."""
    digest = DEFAULT_ARCHIVES / "naiad-server.digest"
    if not digest.exists():
        pytest.skip(f"{digest} missing: run `make images` first")
    archive, name = digest.read_text().split()[:2]
    return Path(archive), name


def _wait(fn, timeout: float = 120, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


def _json(c: KwokCluster, *args: str) -> dict:
    return json.loads(c.kubectl(*args, "-o", "json").stdout)


def _operator_archive() -> Path:
    digest = DEFAULT_ARCHIVES / "naiad-operator.digest"
    if not digest.exists():
        pytest.skip(f"{digest} missing: run `make images` first")
    return Path(digest.read_text().split()[0])


@pytest.fixture(scope="module")
def real_node(kwok_cluster: KwokCluster):
    why = missing_requirements()
    if why:
        pytest.skip(why)
    archive, _ = _server_archive()
    node = RealNode(kwok_cluster, images=[archive, _operator_archive()])
    node.start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def model_repository():
    repo = Path(tempfile.mkdtemp(prefix="naiad-real-node-"))
    repo.chmod(0o755)  # the image's user (10001) reads it through a hostPath volume
    src = ROOT / "tests" / "models" / "identity_fp32"
    shutil.copytree(src, repo / "identity_fp32")
    for p in repo.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield repo
    shutil.rmtree(repo, ignore_errors=True)


def _server_manifests(
    node: RealNode,
    image: str,
    repo: Path,
    app: str = APP,
    extra_args: tuple[str, ...] = (),
    namespace: bool = True,
    cpu_limit: str = "1",
) -> list[dict]:
    """Namespace ``real-node`` (unless `namespace` is False), a Deployment ``app`` of one server pod on the real node
    (CPU limit `cpu_limit`, memory limit 2Gi, one GPU) serving `repo`, and its ClusterIP Service ``app``."""
    labels = {"app": app}
    container = {
        "name": "server",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "serve",
            "--model-repository=/models",
            "--http-port=8000",
            "--grpc-port=8001",
            "--metrics-port=8002",
            *extra_args,
        ],
        "ports": [{"containerPort": 8000, "name": "http"}],
        "readinessProbe": {
            "httpGet": {"path": "/v2/health/ready", "port": 8000},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": 8000}, "periodSeconds": 5},
        # Burstable: a Guaranteed pod's oom_score_adj (-997) needs CAP_SYS_RESOURCE, which root lacks on some CI VMs
        "resources": {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"cpu": cpu_limit, "memory": "2Gi", "nvidia.com/gpu": "1"},
        },
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    }
    return [
        *([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}] if namespace else []),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": app, "namespace": NS},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "nodeSelector": {"kubernetes.io/hostname": node.name},
                        "tolerations": [REAL_NODE_TOLERATION],
                        "terminationGracePeriodSeconds": 5,
                        "containers": [container],
                        "volumes": [{"name": "models", "hostPath": {"path": str(repo), "type": "Directory"}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": app, "namespace": NS},
            "spec": {"selector": labels, "ports": [{"name": "http", "port": 8000, "targetPort": 8000}]},
        },
    ]


def _ready_pod(c: KwokCluster, app: str = APP) -> dict | None:
    pods = _json(c, "get", "pods", "-n", NS, "-l", f"app={app}")["items"]
    for p in pods:
        conds = {x["type"]: x["status"] for x in p.get("status", {}).get("conditions", [])}
        if conds.get("Ready") == "True" and not p["metadata"].get("deletionTimestamp"):
            return p
    return None


def _infer(host: str, port: int = 8000) -> dict:
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}]}
    ).encode()
    req = urllib.request.Request(
        f"http://{host}:{port}/v2/models/identity_fp32/infer",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_real_node_registers_with_gpus(real_node: RealNode):
    node = real_node.node_object()
    assert node is not None
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.36.3"
    assert info["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == real_node.node_ip


def test_server_pod_on_the_real_node(kwok_cluster: KwokCluster, real_node: RealNode, model_repository: Path):
    c = kwok_cluster
    _, image = _server_archive()
    c.apply(_server_manifests(real_node, image, model_repository))
    try:
        pod = _wait(
            lambda: _ready_pod(c), timeout=240, what="server pod Ready through the kubelet's readinessProbe"
        )
        assert pod["spec"]["nodeName"] == real_node.name
        status = pod["status"]["containerStatuses"][0]
        assert status["image"] == image and status["started"] and status["imageID"], status
        assert status["restartCount"] == 0
        assert pod["status"]["podIP"].startswith("198.19.1."), pod["status"]["podIP"]

        # the device plugin's Allocate reached the container's environment
        env = c.kubectl(
            "exec", "-n", NS, pod["metadata"]["name"], "--", "printenv", "NVIDIA_VISIBLE_DEVICES"
        ).stdout
        assert re.fullmatch(r"gpu-\d\n", env), env

        # the ClusterIP Service through kube-proxy's rules, from the host (the pod network's namespace)
        cluster_ip = _json(c, "get", "service", APP, "-n", NS)["spec"]["clusterIP"]
        out = _wait(lambda: _try_infer(cluster_ip), timeout=60, what=f"inference through {cluster_ip}")
        assert out["outputs"][0]["data"] == [1.0, 2.0, 3.0]

        logs = c.kubectl("logs", "-n", NS, pod["metadata"]["name"]).stdout
        assert TRITON_LOG_LINE.search(logs), logs[-2000:]

        # the pod's memory limit reached the container's cgroup
        pid = _container_pid(real_node, pod)
        assert _memory_cgroup(pid, "memory.limit_in_bytes", "memory.max") == 2 * 1024**3
        # the server with a small model fits well inside 512Mi: the OOM test's kill is its large model's doing
        usage = _memory_cgroup(pid, "memory.usage_in_bytes", "memory.current")
        assert usage < 400 * 1024**2, usage
        # the CPU limit of 1 is a CFS quota of one period per period; what 200 requests cost under it
        quota, period = _cpu_quota(pid)
        assert quota == period, (quota, period)
        before = _cpu_stat(pid)
        t0 = time.monotonic()
        latencies = []
        for _ in range(200):
            t = time.monotonic()
            _infer(cluster_ip)
            latencies.append(time.monotonic() - t)
        wall = time.monotonic() - t0
        after = _cpu_stat(pid)
        latencies.sort()
        print(
            f"\nreal node, CPU limit 1: 200 sequential requests via the ClusterIP in {wall:.2f} s, "
            f"p50 {latencies[100] * 1000:.1f} ms, p99 {latencies[198] * 1000:.1f} ms; cgroup cpu.stat delta: "
            + ", ".join(f"{k} {after[k] - before.get(k, 0)}" for k in sorted(after))
        )

        # the container killed -> the kubelet restarts it, the probe makes it Ready again
        os.kill(pid, signal.SIGKILL)

        def restarted():
            p = _ready_pod(c)
            return p if p and p["status"]["containerStatuses"][0]["restartCount"] >= 1 else None

        pod = _wait(restarted, timeout=180, what="the kubelet restarting the killed container")
        last = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
        assert last["exitCode"] == 137, last  # 128 + SIGKILL
        out = _wait(lambda: _try_infer(cluster_ip), timeout=60, what="inference after the restart")
        assert out["outputs"][0]["data"] == [1.0, 2.0, 3.0]
    finally:
        c.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=120s", check=False, timeout=150)


def _try_infer(host: str) -> dict | None:
    try:
        return _infer(host)
    except OSError:
        return None


def _container_pid(node: RealNode, pod: dict) -> int:
    """The host pid of the pod's server container, from containerd's task list."""
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    for line in node.ctr("tasks", "ls").stdout.splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == cid:
            return int(fields[1])
    raise AssertionError(f"container {cid} not among containerd's tasks")


def _memory_cgroup(pid: int, v1_file: str, v2_file: str) -> int:
    """A number from the memory cgroup ``pid`` is in (cgroup v1 memory controller, or v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return int(Path("/sys/fs/cgroup/memory", path.lstrip("/"), v1_file).read_text())
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return int(Path("/sys/fs/cgroup", path.lstrip("/"), v2_file).read_text())
    raise AssertionError(f"no memory cgroup for pid {pid}")


LARGE_MODEL = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        print("large_fp32: allocating 1 GiB of weights", flush=True)
        self.weights = np.ones(256 * 1024 * 1024, dtype=np.float32)  # every page touched

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
"""


def _write_large_model(repo: Path) -> None:
    """large_fp32 (1 GiB of weights) into `repo`, readable by the image's user."""
    (repo / "large_fp32" / "1").mkdir(parents=True)
    (repo / "large_fp32" / "1" / "model.py").write_text(LARGE_MODEL)
    config = (
        (ROOT / "tests/models/identity_fp32/config.pbtxt").read_text().replace("identity_fp32", "large_fp32")
    )
    # in the server's own process, so the server is what exceeds the limit (a process-isolated worker would be
    # the OOM killer's victim and the server would restart it)
    config += 'parameters: { key: "EXECUTION_ISOLATION" value: { string_value: "thread" } }\n'
    (repo / "large_fp32" / "config.pbtxt").write_text(config)
    for p in [repo, *repo.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def test_model_larger_than_the_memory_limit_is_oom_killed(
    kwok_cluster: KwokCluster, real_node: RealNode, tmp_path: Path
):
    """A model whose weights (1 GiB, loaded in the server process) exceed the pod's 512Mi limit: the kernel's
    OOM killer ends the container and the kubelet reports it as OOMKilled (exit code 137)."""
    c = kwok_cluster
    _, image = _server_archive()
    repo = Path(tempfile.mkdtemp(prefix="naiad-real-node-oom-"))
    try:
        _write_large_model(repo)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "oom", "namespace": "default"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": real_node.name},
                "tolerations": [REAL_NODE_TOLERATION],
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "server",
                        "image": image,
                        "imagePullPolicy": "IfNotPresent",
                        "args": ["serve", "--model-repository=/models"],
                        "resources": {"requests": {"memory": "128Mi"}, "limits": {"memory": "512Mi"}},
                        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
                    }
                ],
                "volumes": [{"name": "models", "hostPath": {"path": str(repo), "type": "Directory"}}],
            },
        }
        c.apply(pod)

        def terminated():
            st = _json(c, "get", "pod", "oom", "-n", "default").get("status", {})
            for cs in st.get("containerStatuses", []):
                if "terminated" in cs.get("state", {}):
                    return cs["state"]["terminated"]
            return None

        term = _wait(terminated, timeout=240, what="the server container to be OOM-killed")
        assert term["reason"] == "OOMKilled", term
        assert term["exitCode"] == 137, term
        logs = c.kubectl("logs", "-n", "default", "oom").stdout
        assert "large_fp32: allocating 1 GiB of weights" in logs, logs[-2000:]
    finally:
        c.kubectl(
            "delete", "pod", "oom", "-n", "default", "--grace-period=0", "--force", check=False, timeout=60
        )
        shutil.rmtree(repo, ignore_errors=True)


def _cgroup_dir(pid: int, controller: str) -> Path:
    """The directory of ``pid``'s cgroup for a v1 controller, or its v2 cgroup."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if controller in names:
            return Path("/sys/fs/cgroup", ",".join(names), path.lstrip("/"))
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return Path("/sys/fs/cgroup", path.lstrip("/"))
    raise AssertionError(f"no {controller} cgroup for pid {pid}")


def _cpu_quota(pid: int) -> tuple[int, int]:
    d = _cgroup_dir(pid, "cpu")
    if (d / "cpu.max").exists():
        quota, period = (d / "cpu.max").read_text().split()
        return int(quota), int(period)
    return int((d / "cpu.cfs_quota_us").read_text()), int((d / "cpu.cfs_period_us").read_text())


def _cpu_stat(pid: int) -> dict[str, int]:
    """cpu.stat of ``pid``'s cgroup: periods, throttled periods, throttled time (ns on v1, usec on v2)."""
    text = (_cgroup_dir(pid, "cpu") / "cpu.stat").read_text()
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}


def _cpu_usage_ns(pid: int) -> int:
    """CPU time charged to ``pid``'s cgroup (cpuacct.usage on v1, cpu.stat usage_usec on v2), in ns."""
    d = _cgroup_dir(pid, "cpuacct")
    if (d / "cpuacct.usage").exists():
        return int((d / "cpuacct.usage").read_text())
    return _cpu_stat(pid)["usage_usec"] * 1000


def _throttled_ns(stat: dict[str, int]) -> int:
    return stat["throttled_time"] if "throttled_time" in stat else stat.get("throttled_usec", 0) * 1000


def test_busy_polling_under_a_cpu_quota(
    kwok_cluster: KwokCluster, real_node: RealNode, model_repository: Path
):
    """Server pods under a CPU limit of 1 (a CFS quota of one period per period), one busy polling after requests
    (``--busy-poll-us 200``, the default) and one not (``0``), and the same pair under 250m, side by side: the
    same concurrent load (8 keep-alive connections from ``wrk`` on the host through each ClusterIP) in turns,
    A/B/A/B, with latency from the client and CPU time and throttling (``cpu.stat`` nr_periods / nr_throttled /
    throttled_time) from each pod's cgroup. Every request is answered; the figures are printed (``pytest -s``)
    and kept in e2e/README.md."""
    c = kwok_cluster
    _, image = _server_archive()
    # name -> (server flag, CPU limit); the 250m pair shows a quota that binds (the 2 shared cores here rarely give
    # one server a whole CPU, so the limit of 1 is seldom reached)
    variants = {
        "poll-on": ("--busy-poll-us=200", "1"),
        "poll-off": ("--busy-poll-us=0", "1"),
        "poll-on-250m": ("--busy-poll-us=200", "250m"),
        "poll-off-250m": ("--busy-poll-us=0", "250m"),
    }
    for i, (app, (flag, cpu)) in enumerate(variants.items()):
        c.apply(
            _server_manifests(
                real_node, image, model_repository, app, (flag,), namespace=i == 0, cpu_limit=cpu
            )
        )
    try:
        pids, ips = {}, {}
        for app in variants:
            pod = _wait(lambda app=app: _ready_pod(c, app), timeout=240, what=f"{app} Ready")
            pids[app] = _container_pid(real_node, pod)
            quota, period = _cpu_quota(pids[app])
            share = {"1": 1.0, "250m": 0.25}[variants[app][1]]
            assert quota == round(period * share), (app, quota, period)
            ips[app] = _json(c, "get", "service", app, "-n", NS)["spec"]["clusterIP"]
            _wait(lambda app=app: _try_infer(ips[app]), timeout=60, what=f"inference through {app}'s Service")
        connections, seconds = 8, 3.0
        rows: dict[str, list[tuple]] = {app: [] for app in variants}
        tool = ""
        for _ in range(2):
            for app in variants:
                stat, usage = _cpu_stat(pids[app]), _cpu_usage_ns(pids[app])
                load = concurrent_load(ips[app], 8000, connections, seconds)
                stat2, usage2 = _cpu_stat(pids[app]), _cpu_usage_ns(pids[app])
                assert load.failed == 0 and load.requests > 0, (app, load)
                tool = load.tool
                rows[app].append(
                    (
                        load.rate,
                        load.p50_ms,
                        load.p99_ms,
                        (usage2 - usage) / 1e9 / load.seconds,
                        stat2["nr_periods"] - stat["nr_periods"],
                        stat2["nr_throttled"] - stat["nr_throttled"],
                        (_throttled_ns(stat2) - _throttled_ns(stat)) / 1e6,
                    )
                )
        print(f"\n{tool}, {connections} keep-alive connections via each ClusterIP, {seconds:.0f} s a turn:")
        print("variant          req/s  p50 ms  p99 ms  CPU/s  periods  throttled  throttled ms")
        for app, turns in rows.items():
            for r in turns:
                print(
                    f"{app:14} {r[0]:7.0f} {r[1]:7.2f} {r[2]:7.2f} {r[3]:6.2f} {r[4]:8d} {r[5]:10d} {r[6]:12.1f}"
                )
    finally:
        c.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=120s", check=False, timeout=150)


def test_drain_evicts_the_server_and_uncordon_lets_it_back(
    kwok_cluster: KwokCluster, real_node: RealNode, model_repository: Path
):
    """``kubectl drain`` of the real node evicts the server pod (the kubelet stops it); its replacement stays
    Pending while the node is cordoned (the only node it may run on) and runs again after ``kubectl uncordon``."""
    c = kwok_cluster
    _, image = _server_archive()
    c.apply(_server_manifests(real_node, image, model_repository))
    try:
        first = _wait(lambda: _ready_pod(c), timeout=240, what="server pod Ready")
        c.kubectl(
            "drain",
            real_node.name,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=120s",
            timeout=150,
        )
        node = real_node.node_object()
        assert node is not None and node["spec"].get("unschedulable") is True
        pods = _json(c, "get", "pods", "-n", NS)["items"]
        assert first["metadata"]["name"] not in {p["metadata"]["name"] for p in pods}
        assert pods and all(
            p["status"]["phase"] == "Pending" and not p["spec"].get("nodeName") for p in pods
        ), [(p["metadata"]["name"], p["status"]["phase"]) for p in pods]
        c.kubectl("uncordon", real_node.name)
        second = _wait(lambda: _ready_pod(c), timeout=240, what="the replacement Ready after uncordon")
        assert second["spec"]["nodeName"] == real_node.name
        assert second["metadata"]["name"] != first["metadata"]["name"]
    finally:
        c.kubectl("uncordon", real_node.name, check=False)
        c.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=120s", check=False, timeout=150)


# --- the operator from the chart (after the drain test: draining would evict its replicas) ------------------


MODELS_NS = "models"
OPERATOR_NS = "naiad-system"


@pytest.fixture(scope="module")
def naiad_operator(kwok_cluster: KwokCluster, real_node: RealNode):
    """helm/naiad installed as a user would (2 replicas, leader election), on the real node."""
    c = kwok_cluster
    try:
        c.helm(
            "install",
            "naiad",
            str(ROOT / "helm" / "naiad"),
            "--namespace",
            OPERATOR_NS,
            "--create-namespace",
            "--set",
            "replicaCount=2",
            "--set",
            f"nodeSelector.kubernetes\\.io/hostname={real_node.name}",
            "--set-json",
            f"tolerations=[{json.dumps(REAL_NODE_TOLERATION)}]",
            "--wait",
            "--timeout",
            "240s",
        )
        yield OPERATOR_NS
    finally:
        c.helm("uninstall", "naiad", "--namespace", OPERATOR_NS, "--wait", check=False)
        c.kubectl(
            "delete", "namespace", OPERATOR_NS, "--wait=true", "--timeout=120s", check=False, timeout=150
        )


@pytest.fixture(scope="module")
def models_namespace(kwok_cluster: KwokCluster, naiad_operator: str):
    """Namespace ``models`` with a PersistentVolumeClaim ``models`` bound to a hostPath PV of a repository holding
    identity_fp32 and large_fp32 (the operator's pools load models explicitly, so large_fp32 waits there)."""
    c = kwok_cluster
    repo = Path(tempfile.mkdtemp(prefix="naiad-real-node-pools-"))
    repo.chmod(0o755)
    shutil.copytree(ROOT / "tests" / "models" / "identity_fp32", repo / "identity_fp32")
    _write_large_model(repo)
    c.apply(
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": MODELS_NS}},
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": "naiad-models"},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "hostPath": {"path": str(repo), "type": "Directory"},
                    "claimRef": {"namespace": MODELS_NS, "name": "models"},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "models", "namespace": MODELS_NS},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "volumeName": "naiad-models",
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        ]
    )
    try:
        yield MODELS_NS
    finally:
        c.kubectl("delete", "namespace", MODELS_NS, "--wait=true", "--timeout=120s", check=False, timeout=150)
        c.kubectl("delete", "pv", "naiad-models", "--wait=false", check=False)
        shutil.rmtree(repo, ignore_errors=True)


def _follow_server_log(c: KwokCluster, ns: str, pod: str) -> subprocess.Popen:
    """`kubectl logs -f` of a pod's server container, read once the container has ended (_drain_lines)."""
    return subprocess.Popen(
        [c.bin("kubectl"), "--kubeconfig", c.kubeconfig, "logs", "-f", "-n", ns, pod, "-c", "server"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _drain_lines(followers: list[subprocess.Popen]) -> list[str]:
    """The drain's lines (frontends/transport/drain.py) of each followed log; a stream still open after 30 s is cut."""
    lines = []
    for proc in followers:
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        lines += [
            line for line in out.splitlines() if "after SIGTERM" in line or "drained the frontends" in line
        ]
    return lines


def _pool(name: str, node: RealNode, replicas: int = 1, memory: str = "2Gi", **spec) -> dict:
    """An InferenceServer on the real node, its repository from the ``models`` claim."""
    return {
        "apiVersion": "naiad.dev/v1alpha1",
        "kind": "InferenceServer",
        "metadata": {"name": name, "namespace": MODELS_NS},
        "spec": {
            "replicas": replicas,
            # Burstable (requests below limits): see _server_manifests
            "resources": {
                "limits": {"nvidia.com/gpu": 1, "memory": memory},
                "requests": {"cpu": "100m", "memory": "128Mi"},
            },
            "modelRepository": {"claimName": "models"},
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "tolerations": [REAL_NODE_TOLERATION],
            **spec,
        },
    }


def _inference_model(name: str, pool: str, model_name: str, replicas: int = 1) -> dict:
    return {
        "apiVersion": "naiad.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": MODELS_NS},
        "spec": {"serverRef": {"name": pool}, "modelName": model_name, "replicas": replicas},
    }


def _delete_pool(c: KwokCluster, pool: str, models: list[str]) -> None:
    for model in models:
        c.kubectl(
            "delete", "inferencemodel", model, "-n", MODELS_NS, "--wait=true", "--timeout=60s", check=False
        )
    c.kubectl("delete", "inferenceserver", pool, "-n", MODELS_NS, "--wait=true", "--timeout=60s", check=False)
    _wait(
        lambda: not _json(c, "get", "pods", "-n", MODELS_NS, "-l", f"naiad.dev/server={pool}")["items"],
        timeout=120,
        what=f"the pods of pool {pool} gone",
    )


def _operator_logs(c: KwokCluster) -> str:
    pods = c.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
    logs = c.kubectl(
        "logs", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=naiad", "--tail=40", check=False
    )
    return f"{pods}\n{logs.stdout}{logs.stderr}"


def test_chart_installs_the_operator_on_the_real_node(
    kwok_cluster: KwokCluster, real_node: RealNode, naiad_operator: str, models_namespace: str
):
    """``helm install`` of helm/naiad as a user runs it: the operator's two replicas from its Deployment run in
    containers on the real node, reach the API server in-cluster (ServiceAccount token, the ``kubernetes``
    Service's ClusterIP through kube-proxy), pass the kubelet's liveness probe, and elect one leader. Then an
    InferenceServer and an InferenceModel applied with kubectl: the operator's GPU server pod runs on the real node
    with the repository from a PersistentVolumeClaim, loads the model, and the model's ClusterIP Service answers."""
    c = kwok_cluster
    ns = naiad_operator
    pods = _json(c, "get", "pods", "-n", ns)["items"]
    assert len(pods) == 2
    names = set()
    for p in pods:
        assert p["spec"]["nodeName"] == real_node.name
        st = p["status"]["containerStatuses"][0]
        assert st["ready"] and st["imageID"], st
        names.add(p["metadata"]["name"])

    def leader():
        out = c.kubectl("get", "lease", "naiad", "-n", ns, "-o", "json", check=False)
        holder = json.loads(out.stdout)["spec"].get("holderIdentity") if out.returncode == 0 else None
        return holder if holder and any(n in holder for n in names) else None

    holder = _wait(leader, timeout=120, what="one operator replica holding the Lease")
    try:
        _serve_a_model(c, real_node)
    finally:
        _delete_pool(c, "pool", ["identity"])
    # both replicas kept running: nothing restarted them
    for p in _json(c, "get", "pods", "-n", ns)["items"]:
        assert p["status"]["containerStatuses"][0]["restartCount"] == 0, (holder, p["status"])


def _serve_a_model(c: KwokCluster, node: RealNode) -> None:
    ns = MODELS_NS
    c.apply([_pool("pool", node), _inference_model("identity", "pool", "identity_fp32")])

    def available():
        st = _json(c, "get", "inferencemodel", "identity", "-n", ns).get("status", {})
        return st if st.get("phase") == "Available" else None

    try:
        _wait(available, timeout=300, what="InferenceModel identity Available")
    except AssertionError:
        raise AssertionError(_operator_logs(c)) from None
    pods = _json(c, "get", "pods", "-n", ns, "-l", "naiad.dev/server=pool")["items"]
    assert pods and all(p["spec"]["nodeName"] == node.name for p in pods), [
        p["spec"].get("nodeName") for p in pods
    ]
    ip = _json(c, "get", "service", "identity", "-n", ns)["spec"]["clusterIP"]
    out = _wait(lambda: _try_infer(ip), timeout=60, what=f"inference through the model's Service {ip}")
    assert out["outputs"][0]["data"] == [1.0, 2.0, 3.0]

    # the server container killed: the kubelet restarts it with an empty model set (explicit model control), the
    # operator notices and loads the model again, and the Service answers once more
    os.kill(_container_pid(node, pods[0]), signal.SIGKILL)

    def restarted():
        p = _json(c, "get", "pod", pods[0]["metadata"]["name"], "-n", ns)
        return p if p["status"]["containerStatuses"][0]["restartCount"] >= 1 else None

    _wait(restarted, timeout=120, what="the kubelet restarting the server container")
    out = _wait(lambda: _try_infer(ip), timeout=180, what="inference after the operator reloaded the model")
    assert out["outputs"][0]["data"] == [1.0, 2.0, 3.0]


def _condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def test_oom_killed_load_is_reported_on_the_inference_model(
    kwok_cluster: KwokCluster, real_node: RealNode, models_namespace: str
):
    """An InferenceModel whose model (1 GiB of weights, loaded in the server's process) exceeds its pool's 512Mi
    limit: the kernel's OOM killer ends the server container during the load, the kubelet restarts it, and the
    operator reads the container's ``lastState.terminated.reason`` and says so in the model's status: phase
    Failed, Loaded and Ready with reason OOMKilled and a message naming the pod, the limit and the model."""
    c = kwok_cluster
    ns = models_namespace
    c.apply([_pool("small", real_node, memory="512Mi"), _inference_model("large", "small", "large_fp32")])
    try:

        def oom_reported():
            st = _json(c, "get", "inferencemodel", "large", "-n", ns).get("status", {})
            return st if _condition(st, "Loaded").get("reason") == "OOMKilled" else None

        try:
            status = _wait(oom_reported, timeout=240, what="InferenceModel large reporting the OOM kill")
        except AssertionError as error:
            raise AssertionError(f"{error}\n{_operator_logs(c)}") from None
        pod = _json(c, "get", "pods", "-n", ns, "-l", "naiad.dev/server=small")["items"][0]
        server = next(s for s in pod["status"]["containerStatuses"] if s["name"] == "server")
        assert server["lastState"]["terminated"]["reason"] == "OOMKilled", server
        assert server["lastState"]["terminated"]["exitCode"] == 137, server
        assert server["restartCount"] >= 1, server
        loaded, ready = _condition(status, "Loaded"), _condition(status, "Ready")
        print(f"\nInferenceModel large: phase {status['phase']}; Loaded: {loaded['message']}")
        assert status["phase"] == "Failed", status
        assert loaded["status"] == "False" and ready["status"] == "False", status
        assert ready["reason"] == "OOMKilled", ready
        for part in (f"pod {pod['metadata']['name']}", "OOM-killed", "memory limit 512Mi", "large_fp32"):
            assert part in loaded["message"], (part, loaded["message"])
        # the kubelet restarted the container: it comes back empty (explicit model control) and Ready; only the
        # load failed
        _wait(
            lambda: _json(c, "get", "pods", "-n", ns, "-l", "naiad.dev/server=small")["items"][0]["status"][
                "containerStatuses"
            ][0].get("ready"),
            timeout=120,
            what="the restarted server container Ready",
        )
    finally:
        _delete_pool(c, "small", ["large"])


def test_rolling_update_under_traffic_from_a_client_pod(
    kwok_cluster: KwokCluster, real_node: RealNode, models_namespace: str
):
    """A pool of 2 (PodDisruptionBudget maxUnavailable 1, rollout maxSurge 1 / maxUnavailable 0, the models-ready
    readiness gate) and a model on both pods; a client pod on the real node calls the model's ClusterIP Service
    through kube-proxy the whole time (2 threads opening a new connection per request, 2 reusing one keep-alive
    connection each). A change to the pod template (an annotation) rolls both pods; every request on a new
    connection is answered (keep-alive failures are printed: see e2e/README.md)."""
    c = kwok_cluster
    ns = models_namespace
    _, image = _server_archive()
    c.apply([_pool("roll", real_node, replicas=2), _inference_model("rolled", "roll", "identity_fp32", 2)])
    followers: list[subprocess.Popen] = []
    try:

        def available():
            st = _json(c, "get", "inferencemodel", "rolled", "-n", ns).get("status", {})
            return st if st.get("phase") == "Available" and st.get("availableReplicas") == 2 else None

        try:
            _wait(available, timeout=240, what="InferenceModel rolled Available on 2 pods")
        except AssertionError as error:
            raise AssertionError(f"{error}\n{_operator_logs(c)}") from None
        pdb = _json(c, "get", "poddisruptionbudget", "roll", "-n", ns)
        assert pdb["spec"]["maxUnavailable"] == 1, pdb["spec"]
        _wait(
            lambda: (
                _json(c, "get", "poddisruptionbudget", "roll", "-n", ns)["status"].get("currentHealthy") == 2
            ),
            timeout=60,
            what="the PodDisruptionBudget counting 2 healthy pods",
        )
        before = {
            p["metadata"]["name"]
            for p in _json(c, "get", "pods", "-n", ns, "-l", "naiad.dev/server=roll")["items"]
        }
        ip = _json(c, "get", "service", "rolled", "-n", ns)["spec"]["clusterIP"]
        url = f"http://{ip}:8000/v2/models/identity_fp32/infer"
        c.apply(client_pod("client", ns, image, url, real_node.name, threads=2, keepalive=2))
        _wait(
            lambda: "client: first answer" in c.kubectl("logs", "-n", ns, "client", check=False).stdout,
            timeout=120,
            what="the client pod's first answer through the Service",
        )
        time.sleep(2)  # some traffic before the rollout
        # the old pods' server logs, followed until their containers end: their drain says how long each listened
        # after SIGTERM and how many new connections still came (kube-proxy's lag past the preStop sleep)
        followers += [_follow_server_log(c, ns, pod) for pod in sorted(before)]
        t0 = time.monotonic()
        c.kubectl(
            "patch",
            "inferenceserver",
            "roll",
            "-n",
            ns,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"podAnnotations": {"naiad.e2e/rollout": "2"}}}),
        )

        def rolled():
            pods = _json(c, "get", "pods", "-n", ns, "-l", "naiad.dev/server=roll")["items"]
            names = {p["metadata"]["name"] for p in pods}
            st = _json(c, "get", "inferencemodel", "rolled", "-n", ns).get("status", {})
            held = {p["pod"] for p in st.get("placements", []) if p["state"] == "Loaded"}
            done = (
                len(pods) == 2 and not names & before and held == names and st.get("availableReplicas") == 2
            )
            return names if done else None

        try:
            after = _wait(rolled, timeout=240, what="both pods replaced and holding the model")
        except AssertionError as error:
            raise AssertionError(f"{error}\n{_operator_logs(c)}") from None
        rollout = time.monotonic() - t0
        drains = _drain_lines(followers)
        time.sleep(2)  # and some after it
        c.kubectl("exec", "-n", ns, "client", "--", "touch", "/tmp/stop")
        summary = _wait(
            lambda: client_summary(c.kubectl("logs", "-n", ns, "client", check=False).stdout),
            timeout=60,
            what="the client's summary",
        )
        print(
            f"\nrolling update of 2 pods ({sorted(before)} -> {sorted(after)}) in {rollout:.1f} s: "
            f"client pod: {summary['ok']} answered ({summary['ok_keepalive']} on keep-alive connections), "
            f"{summary['failed_new']} failed on new connections, {summary['failed_keepalive']} on keep-alive ones, "
            f"p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms\nthe old pods' drains:\n"
            + "\n".join(drains)
        )
        assert summary["ok"] > 100 and summary["ok_keepalive"] > 100, summary
        # Every request is answered, on new connections and on keep-alive ones: the old pods' servers drain
        # (frontends/transport/drain.py: a request on an open connection gets its answer with Connection: close, so the
        # client reconnects through kube-proxy to a live pod; before the drain 6 of 8,402 failed here), and they
        # listen on while kube-proxy still sends them new connections (--drain-quiet-secs: 4 refused in a CI run).
        failures = json.dumps(summary["failures"], indent=1) + "\n" + "\n".join(drains)
        assert summary["failed_new"] == 0, failures
        assert summary["failed_keepalive"] == 0, failures
    finally:
        for proc in followers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        c.kubectl("delete", "pod", "client", "-n", ns, "--grace-period=0", "--force", check=False, timeout=60)
        _delete_pool(c, "roll", ["rolled"])
