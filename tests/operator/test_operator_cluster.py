"""The operator against a real Kubernetes control plane (kube-apiserver, controller-manager, scheduler, etcd from
the pinned release; kwok for nodes; e2e/podrunner.py runs the server pods as local `naiad serve` processes).

The chart is installed with helm and the operator runs with its ServiceAccount's token, so the chart's RBAC is
what every test exercises. Covers: CRDs accepted by the API server (structural schemas, CEL rules), children
created with owner references,
models loaded live into pods and routed through per-model Services, config changes reloaded without pod
restarts, self-healing after a server restart, scale-up, suspension, deletion with unload, dedicated pools,
rejected specs, the operator's own restart, the control API guarded by the installation's credential (a client
pod without it is refused load, unload and shm registration while it can infer), its rotation, and a TLS pool.

Slow (a cluster start, about a minute); skipped without the e2e binaries (see find_binaries) or the server's
dependencies.
Run: pytest tests/operator/test_operator_cluster.py -m slow
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
NS = "naiad-it"
OPERATOR_NS = "naiad-system"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

cluster_mod = pytest.importorskip("e2e.cluster")
podrunner_mod = pytest.importorskip("e2e.podrunner")
images_mod = pytest.importorskip("e2e.images")

# NAIAD_E2E_IMAGES=1 (`make e2e-images`): the server pods and the operator run from the built images
# (`make images`) instead of this interpreter's virtualenv.
IMAGE_MODE = images_mod.image_mode()
SERVER_IMAGE = "ghcr.io/naiad-dev/naiad-server:0.1.0"
OPERATOR_IMAGE = "ghcr.io/naiad-dev/naiad-operator:0.1.0"
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def _server_importable() -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", "import naiad.cli"], env=_env(), capture_output=True, check=False
    )
    return probe.returncode == 0


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "operator"), str(ROOT / "server"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), **extra}


def wait(fn, timeout=120.0, interval=0.5, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (cluster_mod.ClusterError, OSError, KeyError, IndexError, ValueError) as error:
            last = error
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Harness:
    def __init__(self, cluster, runner, repo: Path, workdir: Path, images=None):
        self.cluster = cluster
        self.runner = runner
        self.repo = repo
        self.workdir = workdir
        self.images = images  # image mode: the ImageStore the operator and the pods run from
        self.operator: subprocess.Popen | None = None
        self.operator_pidns: str | None = None  # image mode: the operator container's PID namespace
        self.operator_log = workdir / "operator.log"
        self.health_port = free_port()

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.cluster.kubectl(*args, check=check)

    def get(self, kind: str, name: str | None = None, selector: str | None = None) -> dict:
        args = ["-n", NS, "get", kind] + ([name] if name else []) + (["-l", selector] if selector else [])
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def exists(self, kind: str, name: str) -> bool:
        return self.kubectl("-n", NS, "get", kind, name, check=False).returncode == 0

    def apply(self, doc: dict) -> None:
        doc = {**doc, "metadata": {**doc["metadata"], "namespace": NS}}
        self.cluster.apply(doc)

    def operator_kubeconfig(self) -> str:
        """A kubeconfig with the token of the ServiceAccount the chart created: the operator runs with exactly
        the chart's RBAC, so a missing permission fails these tests."""
        path = self.workdir / "operator-kubeconfig.yaml"
        token = self.kubectl("-n", OPERATOR_NS, "create", "token", "naiad", "--duration=2h").stdout.strip()
        admin = yaml.safe_load(Path(self.cluster.kubeconfig).read_text())
        context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
        cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "operator",
                    "clusters": [cluster],
                    "users": [{"name": "operator", "user": {"token": token}}],
                    "contexts": [
                        {"name": "operator", "context": {"cluster": cluster["name"], "user": "operator"}}
                    ],
                }
            )
        )
        return str(path)

    def service_account_volume(self) -> Path:
        """What the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount: the ServiceAccount's token
        (TokenRequest), the cluster's CA and the namespace."""
        from kubernetes import client as kclient
        from kubernetes import config as kconfig

        path = self.workdir / "serviceaccount"
        path.mkdir(exist_ok=True)
        token = self.kubectl("-n", OPERATOR_NS, "create", "token", "naiad", "--duration=2h").stdout.strip()
        cfg = kclient.Configuration()
        kconfig.load_kube_config(config_file=self.cluster.kubeconfig, client_configuration=cfg)
        assert cfg.ssl_ca_cert, "the cluster's kubeconfig names no CA: in-cluster config needs one"
        (path / "token").write_text(token)
        (path / "ca.crt").write_bytes(Path(cfg.ssl_ca_cert).read_bytes())
        (path / "namespace").write_text(OPERATOR_NS)
        for f in path.iterdir():
            f.chmod(0o644)
        return path

    def start_operator_image(self) -> None:
        """The operator from its image, as its pod would run: in-cluster config (KUBERNETES_SERVICE_HOST/PORT and
        the ServiceAccount volume), the image's user and entrypoint, the chart's flags."""
        from urllib.parse import urlsplit

        from kubernetes import client as kclient
        from kubernetes import config as kconfig

        cfg = kclient.Configuration()
        kconfig.load_kube_config(config_file=self.cluster.kubeconfig, client_configuration=cfg)
        api = urlsplit(cfg.host)  # the apiserver; kube-proxy would route the kubernetes Service's IP to it
        spec = images_mod.ContainerSpec(
            self.images.get(OPERATOR_IMAGE),
            args=["--namespace", NS, f"--liveness=http://127.0.0.1:{self.health_port}/healthz", "--verbose"],
            env={
                "KUBERNETES_SERVICE_HOST": api.hostname,
                "KUBERNETES_SERVICE_PORT": str(api.port or 443),
                "NAIAD_RESYNC_SECONDS": "2",
                "NAIAD_LOAD_RETRY_SECONDS": "2",
                "NAIAD_SERVER_IMAGE": SERVER_IMAGE,
            },
            mounts=[images_mod.Mount(self.service_account_volume(), SA_MOUNT, read_only=True)],
            hostname="naiad-operator",
        )
        with open(self.operator_log, "a") as log:
            self.operator = subprocess.Popen(
                spec.argv(), env=spec.full_env(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
            )
        self.operator_pidns = images_mod.pid_namespace(self.operator.pid)

    def start_operator(self) -> None:
        if self.images is not None:
            self.start_operator_image()
            return
        kubeconfig = self.operator_kubeconfig()
        with open(self.operator_log, "a") as log:  # the child keeps its own copy of the descriptor
            self.operator = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "naiad_operator",
                    "--namespace",
                    NS,
                    f"--liveness=http://127.0.0.1:{self.health_port}/healthz",
                    "--verbose",
                ],
                env=_env(
                    KUBECONFIG=kubeconfig,
                    NAIAD_RESYNC_SECONDS="2",
                    NAIAD_LOAD_RETRY_SECONDS="2",
                    NAIAD_SERVER_IMAGE="naiad-server:it",
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )

    def stop_operator(self) -> None:
        if self.operator and self.images is not None:
            # SIGINT to the operator in its container, SIGKILL to the container after 30 s; returns once every
            # process of it has exited
            images_mod.stop_container(self.operator, self.operator_pidns, grace=30, sig=signal.SIGINT)
        elif self.operator and self.operator.poll() is None:
            self.operator.send_signal(signal.SIGINT)
            try:
                self.operator.wait(30)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait()

    def model_status(self, name: str) -> dict:
        return self.get("inferencemodel", name).get("status") or {}

    def credential(self) -> str:
        """The installation's control credential (the servers' control APIs answer only it)."""
        data = self.kubectl(
            "-n",
            OPERATOR_NS,
            "get",
            "secret",
            "naiad-control-credential",
            "-o",
            "jsonpath={.data.credential}",
        ).stdout
        return base64.b64decode(data).decode()

    def index(self, ip: str) -> dict[str, str]:
        request = urllib.request.Request(
            f"http://{ip}:8000/v2/repository/index",
            data=b"{}",
            method="POST",
            headers={"Content-Type": "application/json", "naiad-control-key": self.credential()},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return {e["name"]: e.get("state", "") for e in json.loads(response.read())}

    def endpoints(self, service: str) -> set[str]:
        slices = self.get("endpointslices", selector=f"kubernetes.io/service-name={service}")["items"]
        return {
            a
            for s in slices
            for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready")
            for a in e["addresses"]
        }

    def infer(self, ip: str) -> list[float]:
        body = {
            "inputs": [
                {"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]},
                {"name": "INPUT1", "shape": [4], "datatype": "FP32", "data": [1, 1, 1, 1]},
            ]
        }
        request = urllib.request.Request(
            f"http://{ip}:8000/v2/models/add_sub/infer",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            outputs = {o["name"]: o["data"] for o in json.loads(response.read())["outputs"]}
        return outputs["OUTPUT0"]

    def diagnostics(self) -> str:
        objects = self.kubectl(
            "-n", NS, "get", "inferenceservers,inferencemodels,hpa", "-o", "yaml", check=False
        )
        pods = self.kubectl("-n", NS, "get", "pods", "-o", "wide", "--show-labels", check=False)
        parts = [f"--- objects ---\n{objects.stdout[-20000:]}\n--- pods ---\n{pods.stdout}"]
        parts += [
            f"--- operator log ---\n{self.operator_log.read_text()[-6000:] if self.operator_log.exists() else ''}"
        ]
        for proc in self.runner.processes():
            parts.append(f"--- {proc.pod} ---\n{self.runner.logs(proc.namespace, proc.pod)[-2000:]}")
        return "\n".join(parts)


def find_binaries() -> Path:
    """The e2e binaries: $NAIAD_E2E_BIN, a build when NAIAD_E2E_BUILD=1, else the newest complete build in the
    cache. Never starts a (long) build on its own, so plain `pytest tests` stays quick where none exists."""
    try:
        if os.environ.get("NAIAD_E2E_BIN") or os.environ.get("NAIAD_E2E_BUILD") == "1":
            return cluster_mod.build_binaries(quiet=True)
    except (cluster_mod.GoMissing, cluster_mod.ClusterError) as error:
        pytest.skip(f"no e2e cluster binaries: {error}")
    cache = Path(os.environ.get("NAIAD_E2E_CACHE", Path.home() / ".cache" / "naiad-e2e"))
    builds = sorted(cache.glob("*/.complete"), key=lambda p: p.stat().st_mtime, reverse=True)
    for marker in builds:
        if all((marker.parent / "bin" / b).exists() for b in cluster_mod.BINARIES):
            return marker.parent / "bin"
    pytest.skip("no e2e cluster binaries: build them (e2e/cluster/build.sh, or NAIAD_E2E_BUILD=1) first")


@contextlib.contextmanager
def running_cluster(
    workdir: Path,
    nodes: int = 1,
    helm_sets: Sequence[str] = (),
    operator: bool = True,
    kwokctl_args: Sequence[str] = (),
):
    """A cluster with the chart installed, a pod runner on `nodes` GPU nodes, and (with `operator`) the operator
    running; yields the Harness and tears everything down afterwards."""
    bin_dir = find_binaries()
    if not _server_importable():
        pytest.skip("the naiad server's dependencies are not installed in this interpreter")
    repo = workdir / "models"
    shutil.copytree(ROOT / "tests" / "models" / "add_sub", repo / "add_sub")
    # Own work directories (not the shared e2e/.work), so other suites' cleanup cannot touch this cluster.
    gpu_nodes = [cluster_mod.GpuNode(f"gpu-node-{i}", f"198.18.{i}.0/24") for i in range(nodes)]
    cluster = cluster_mod.KwokCluster(
        bin_dir=bin_dir, workdir=workdir / "cluster", gpu_nodes=gpu_nodes, extra_kwokctl_args=kwokctl_args
    )
    common = {
        "workdir": workdir / "pods",
        "extra_args": podrunner_mod.bind_to_pod_ip,
        "max_probe_period": 1.0,
    }
    if IMAGE_MODE:
        missing = images_mod.missing_tools()
        if missing:
            pytest.fail(f"NAIAD_E2E_IMAGES=1: {missing}")
        images = images_mod.ImageStore.from_build()
        for name in (SERVER_IMAGE, OPERATOR_IMAGE):
            images.get(name)  # unpacked up front (once per image ID), not inside a pod's start
        # The pools name their repository by a plain path (and models by file://): a node would need it there,
        # so every image container gets it read-only at that path.
        runner = podrunner_mod.PodRunner(
            cluster.kubeconfig,
            cluster.runner_node_names,
            images=images,
            image_binds={str(repo): str(repo)},
            grace_cap=5.0,
            **common,
        )
    else:
        images = None
        launcher = workdir / "naiad"
        launcher.write_text(
            f"#!/bin/sh\nexec {sys.executable} -c 'import sys; from naiad.cli import main; "
            f'sys.exit(main())\' "$@"\n'
        )
        launcher.chmod(0o755)
        runner = podrunner_mod.PodRunner(
            cluster.kubeconfig,
            cluster.runner_node_names,
            executables={"naiad": str(launcher)},
            extra_env={"PYTHONPATH": _env()["PYTHONPATH"]},
            grace_cap=5.0,
            **common,
        )
    h = Harness(cluster, runner, repo, workdir, images)
    try:
        cluster.create()
        # The chart installs the CRDs, the ServiceAccount and its RBAC. Its operator pod must not be scheduled
        # (there is no image to run here): the operator runs as a local process with the chart's credentials.
        cluster.helm(
            "install",
            "naiad",
            str(ROOT / "helm" / "naiad"),
            "--namespace",
            OPERATOR_NS,
            "--create-namespace",
            "--set-string",
            "nodeSelector.naiad\\.dev/unschedulable=true",
            *(arg for value in helm_sets for arg in ("--set", value)),
        )
        cluster.kubectl(
            "wait",
            "--for=condition=Established",
            "crd/inferenceservers.naiad.dev",
            "crd/inferencemodels.naiad.dev",
            "--timeout=60s",
        )
        cluster.kubectl("create", "namespace", NS)
        runner.start()
        if operator:
            h.start_operator()
        yield h
    except BaseException:
        print(h.diagnostics())
        raise
    finally:
        h.stop_operator()
        runner.stop()
        cluster.delete()


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    # One replica without leader election: the tests below stop and start it at will.
    with running_cluster(
        tmp_path_factory.mktemp("naiad-it"), helm_sets=["replicaCount=1", "leaderElection.enabled=false"]
    ) as h:
        yield h


@pytest.fixture
def report(harness, request):
    """The harness; prints the operator's and the pods' logs when the test fails."""
    failed_before = request.session.testsfailed
    yield harness
    if request.session.testsfailed > failed_before:
        print(harness.diagnostics())


def pool(name="pool", replicas=2, **spec):
    return {
        "apiVersion": "naiad.dev/v1alpha1",
        "kind": "InferenceServer",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "resources": {"limits": {"nvidia.com/gpu": 1}},
            "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}],
            **spec,
        },
    }


def model(name, **spec):
    return {
        "apiVersion": "naiad.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": name},
        "spec": spec,
    }


def test_chart_installs_with_helm(harness):
    release = json.loads(harness.cluster.helm("list", "-n", OPERATOR_NS, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in release] == [("naiad", "deployed")]
    deployment = json.loads(
        harness.kubectl("-n", OPERATOR_NS, "get", "deployment", "naiad", "-o", "json").stdout
    )
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    for name in ("naiad", "naiad-edit", "naiad-view"):
        harness.kubectl("get", "clusterrole", name)
    # the operator's identity may do what it needs and nothing it should not
    can = harness.kubectl(
        "auth",
        "can-i",
        "patch",
        "pods/status",
        "-n",
        NS,
        f"--as=system:serviceaccount:{OPERATOR_NS}:naiad",
        check=False,
    )
    assert can.stdout.strip() == "yes"
    cannot = harness.kubectl(  # Secrets by name only (its credential, the pools' copies, TLS ca.crt)
        "auth",
        "can-i",
        "list",
        "secrets",
        "-n",
        NS,
        f"--as=system:serviceaccount:{OPERATOR_NS}:naiad",
        check=False,
    )
    assert cannot.stdout.strip() == "no"


def test_crd_validation_rejects_bad_specs(harness):
    for doc in (
        model("bad-replicas", serverRef={"name": "pool"}, replicas=-1),
        model("both", serverRef={"name": "pool"}, server={}),
        model("x" * 48, serverRef={"name": "pool"}),
        pool("bad-policy", imagePullPolicy="Sometimes"),
        pool("bad-range", minReplicas=3, maxReplicas=2),
    ):
        result = harness.cluster.kubectl("-n", NS, "apply", "-f", "-", input=json.dumps(doc), check=False)
        assert result.returncode != 0, doc["metadata"]["name"]
        assert "Invalid" in result.stderr or "invalid" in result.stderr, result.stderr


def test_pool_children_are_created_and_owned(report):
    h = report
    h.apply(
        pool(modelRepository={"path": str(h.repo)}, capacity={"maxModels": 4}, minReplicas=1, maxReplicas=4)
    )
    uid = wait(lambda: h.get("inferenceserver", "pool")["metadata"]["uid"], what="pool uid")
    deployment = wait(lambda: h.get("deployment", "pool"), what="Deployment")
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == uid
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--model-control-mode=explicit" in args and f"--model-repository={h.repo}" in args
    for kind, name in (("service", "pool"), ("service", "pool-headless"), ("hpa", "pool")):
        obj = wait(lambda kind=kind, name=name: h.get(kind, name), what=f"{kind} {name}")
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    hpa = h.get("hpa", "pool")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "InferenceServer"
    # pods start (scheduled by the real scheduler onto the GPU node) and the pool reports them
    wait(
        lambda: (h.get("inferenceserver", "pool").get("status") or {}).get("readyReplicas") == 2,
        180,
        what="2 ready pods",
    )
    if IMAGE_MODE:  # the pods run from the server image, not from this virtualenv
        procs = [p for p in h.runner.processes() if p.namespace == NS and p.pod.startswith("pool-")]
        assert len(procs) == 2 and all(p.image_id for p in procs), procs
    status = h.get("inferenceserver", "pool")["status"]
    assert status["selector"] == "naiad.dev/server=pool"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["WorkloadReady"] == "True"
    # the scale subresource works for kubectl (and the HPA)
    scale = json.loads(
        h.kubectl(
            "-n", NS, "get", "--raw", f"/apis/naiad.dev/v1alpha1/namespaces/{NS}/inferenceservers/pool/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 2 and scale["status"]["selector"] == "naiad.dev/server=pool"


def pods_holding(h, name: str) -> list[dict]:
    return h.get("pods", selector=f"naiad.dev/server=pool,naiad.dev/model-{name}=loaded")["items"]


def test_model_is_loaded_live_and_routed(report):
    h = report
    h.apply(model("add-sub", serverRef={"name": "pool"}, modelName="add_sub", replicas=1))
    status = wait(
        lambda: (s := h.model_status("add-sub")).get("phase") == "Available" and s,
        120,
        what="model Available",
    )
    assert status["availableReplicas"] == 1 and status["server"] == "pool"
    assert status["endpoint"]["http"] == f"http://add-sub.{NS}.svc:8000/v2/models/add_sub"
    (holder,) = pods_holding(h, "add-sub")
    ip = holder["status"]["podIP"]
    assert h.index(ip)["add_sub"] == "READY"
    assert h.infer(ip) == [2.0, 3.0, 4.0, 5.0]
    gate = {c["type"]: c["status"] for c in holder["status"]["conditions"]}["naiad.dev/models-ready"]
    assert gate == "True"
    # the model's Service reaches only the pod that holds it
    assert wait(lambda: h.endpoints("add-sub") == {ip}, 60, what="model Service endpoints")
    assert len(h.endpoints("pool")) == 2
    # kubectl get im shows the printer columns
    table = h.kubectl("-n", NS, "get", "im", "add-sub").stdout
    assert "Available" in table and "add_sub" in table and "pool" in table
    events = h.kubectl("-n", NS, "get", "events", "--field-selector", "involvedObject.name=add-sub").stdout
    assert "Loaded" in events


def test_kubectl_get_shows_pools_and_models(report):
    h = report
    models = h.kubectl("-n", NS, "get", "im", "-o", "wide").stdout
    pools = h.kubectl("-n", NS, "get", "isrv").stdout
    print(f"\n$ kubectl get im -o wide\n{models}\n$ kubectl get isrv\n{pools}")
    assert models.split("\n")[0].split() == [
        "NAME",
        "MODEL",
        "SERVER",
        "PHASE",
        "AVAILABLE",
        "DESIRED",
        "ENDPOINT",
        "AGE",
    ]
    assert pools.split("\n")[0].split() == ["NAME", "REPLICAS", "READY", "MODELS", "STATUS", "AGE"]
    row = dict(zip(models.split("\n")[0].split(), models.split("\n")[1].split()))
    assert row["PHASE"] == "Available" and row["AVAILABLE"] == "1" and row["DESIRED"] == "1"
    assert h.kubectl("get", "naiad", "-n", NS).returncode == 0  # the category lists both kinds
    # No metrics adapter here: the pool serves, but says its autoscaler cannot read the queue-time metric.
    conditions = {c["type"]: c for c in h.get("inferenceserver", "pool")["status"]["conditions"]}
    assert conditions["WorkloadReady"]["status"] == "True"
    if conditions["AutoscalerReady"]["status"] != "True":
        assert conditions["Ready"]["reason"] == conditions["AutoscalerReady"]["reason"]
        print(conditions["AutoscalerReady"])


def test_config_change_reloads_without_restarting_pods(report):
    h = report
    pods_before = {
        p["metadata"]["uid"]: p["status"]["containerStatuses"][0]["restartCount"]
        for p in h.get("pods", selector="naiad.dev/server=pool")["items"]
    }
    revision = h.model_status("add-sub")["revision"]
    h.kubectl(
        "-n",
        NS,
        "patch",
        "im",
        "add-sub",
        "--type=merge",
        "-p",
        json.dumps(
            {
                "spec": {
                    "config": {
                        "name": "add_sub",
                        "backend": "python",
                        "input": [
                            {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                            {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]},
                        ],
                        "output": [
                            {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                            {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [4]},
                        ],
                        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
                    }
                }
            }
        ),
    )
    wait(
        lambda: (
            (s := h.model_status("add-sub")).get("revision") != revision and s.get("phase") == "Available"
        ),
        120,
        what="new revision Available",
    )
    pods_after = {
        p["metadata"]["uid"]: p["status"]["containerStatuses"][0]["restartCount"]
        for p in h.get("pods", selector="naiad.dev/server=pool")["items"]
    }
    assert pods_after == pods_before  # same pods, no restarts


def test_scale_up_then_self_heal_after_a_server_restart(report):
    h = report
    h.kubectl("-n", NS, "scale", "im", "add-sub", "--replicas=2")
    wait(lambda: h.model_status("add-sub").get("availableReplicas") == 2, 120, what="2 replicas")
    victim = pods_holding(h, "add-sub")[0]
    name, ip = victim["metadata"]["name"], victim["status"]["podIP"]
    proc = h.runner.get(NS, name)
    os.kill(proc.pid, signal.SIGKILL)  # the container dies; the runner restarts it like a kubelet would
    wait(lambda: h.runner.get(NS, name).restart_count >= 1, 60, what="container restart")
    wait(lambda: h.index(ip).get("add_sub") == "READY", 120, what="model reloaded after the restart")
    wait(lambda: h.model_status("add-sub").get("availableReplicas") == 2, 60, what="2 replicas again")
    assert h.infer(ip) == [2.0, 3.0, 4.0, 5.0]


def test_suspend_and_delete_unload_everywhere(report):
    h = report
    ips = [p["status"]["podIP"] for p in h.get("pods", selector="naiad.dev/server=pool")["items"]]
    h.kubectl("-n", NS, "patch", "im", "add-sub", "--type=merge", "-p", '{"spec": {"suspended": true}}')
    wait(lambda: h.model_status("add-sub").get("phase") == "Suspended", 60, what="Suspended")
    wait(lambda: all(h.index(ip).get("add_sub") != "READY" for ip in ips), 60, what="unloaded")
    assert pods_holding(h, "add-sub") == []
    h.kubectl("-n", NS, "patch", "im", "add-sub", "--type=merge", "-p", '{"spec": {"suspended": false}}')
    wait(lambda: h.model_status("add-sub").get("phase") == "Available", 120, what="Available again")
    h.kubectl("-n", NS, "delete", "im", "add-sub", "--timeout=90s")
    assert all(h.index(ip).get("add_sub") != "READY" for ip in ips)
    assert pods_holding(h, "add-sub") == []
    assert wait(lambda: not h.exists("service", "add-sub"), 60, what="model Service garbage-collected")


def test_invalid_model_is_reported_not_retried(report):
    h = report
    h.apply(model("ghost", serverRef={"name": "pool"}, modelName="does_not_exist"))
    status = wait(lambda: (s := h.model_status("ghost")).get("phase") == "Failed" and s, 120, what="Failed")
    assert status["lastFailure"]["message"]
    h.apply(model("orphan", serverRef={"name": "missing-pool"}))
    wait(lambda: h.model_status("orphan").get("phase") == "Pending", 60, what="Pending without a pool")
    h.kubectl("-n", NS, "delete", "im", "ghost", "orphan", "--timeout=90s")


def test_operator_restart_converges(report):
    h = report
    h.stop_operator()
    h.apply(model("late", serverRef={"name": "pool"}, modelName="add_sub", replicas=1))
    time.sleep(2)
    assert not h.model_status("late")
    h.start_operator()
    wait(lambda: h.model_status("late").get("phase") == "Available", 120, what="Available after restart")
    with urllib.request.urlopen(f"http://127.0.0.1:{h.health_port}/healthz", timeout=5) as response:
        assert response.status == 200
    h.kubectl("-n", NS, "delete", "im", "late", "--timeout=90s")


def test_dedicated_pool_from_one_resource(report):
    h = report
    h.apply(
        model(
            "solo",
            modelName="add_sub",
            replicas=1,
            storage={"uri": f"file://{h.repo}"},
            server={
                "resources": {"limits": {"nvidia.com/gpu": 1}},
                "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}],
            },
        )
    )
    server = wait(lambda: h.get("inferenceserver", "solo-server"), 60, what="dedicated InferenceServer")
    assert server["metadata"]["ownerReferences"][0]["kind"] == "InferenceModel"
    assert server["spec"]["modelRepository"] == {"path": str(h.repo)}
    wait(lambda: h.model_status("solo").get("phase") == "Available", 180, what="dedicated model Available")
    h.kubectl("-n", NS, "delete", "im", "solo", "--timeout=90s")
    wait(lambda: not h.exists("inferenceserver", "solo-server"), 90, what="dedicated pool garbage-collected")


def adapter_rules(h: Harness) -> dict:
    """The prometheus-adapter rule exactly as the chart renders it."""
    rendered = h.cluster.helm(
        "template", "naiad", str(ROOT / "helm" / "naiad"), "--set", "prometheusAdapter.rules.enabled=true"
    ).stdout
    config_map = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ConfigMap")
    return yaml.safe_load(config_map["data"]["config.yaml"])


def test_autoscaling_on_queue_time_through_prometheus_adapter(report):
    """Prometheus scrapes the pods, prometheus-adapter serves the chart's rule, and the real HPA controller scales
    a shared pool (on its pods' queue time) and a model with a dedicated pool (on that model's queue time only)
    through their scale subresources; the operator follows with pods and placements."""
    h = report
    monitoring = pytest.importorskip("e2e.monitoring")
    if not monitoring.find_prometheus():
        pytest.skip("prometheus binary missing (apt-get install prometheus)")
    fast = {"targetQueueTimeMicroseconds": 1, "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}}
    h.apply(
        pool(
            "auto",
            replicas=1,
            minReplicas=1,
            maxReplicas=3,
            modelRepository={"path": str(h.repo)},
            autoscaling=fast,
        )
    )
    h.apply(model("busy", serverRef={"name": "auto"}, modelName="add_sub", replicas=1))
    h.apply(
        model(
            "scaled",
            modelName="add_sub",
            replicas=1,
            minReplicas=1,
            maxReplicas=2,
            autoscaling=fast,
            storage={"uri": f"file://{h.repo}"},
            server={
                "resources": {"limits": {"nvidia.com/gpu": 1}},
                "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}],
            },
        )
    )
    for name in ("busy", "scaled"):
        wait(
            lambda name=name: h.model_status(name).get("phase") == "Available", 180, what=f"{name} Available"
        )
    stop = threading.Event()

    def load() -> None:  # concurrent requests, so some wait in the scheduler queue
        while not stop.is_set():
            for selector in ("naiad.dev/model-busy=loaded", "naiad.dev/model-scaled=loaded"):
                for p in h.get("pods", selector=selector)["items"]:
                    try:
                        h.infer(p["status"]["podIP"])
                    except OSError:
                        pass

    workers = [threading.Thread(target=load, daemon=True) for _ in range(12)]
    prometheus = monitoring.Prometheus(kubeconfig=h.cluster.kubeconfig, workdir=h.workdir / "prometheus")
    adapter = monitoring.PrometheusAdapter(
        h.cluster, "", rules=adapter_rules(h), workdir=h.workdir / "adapter"
    )
    try:
        prometheus.start()
        adapter.prometheus_url = prometheus.url
        adapter.start()
        for worker in workers:
            worker.start()
        metric = "naiad_queue_time_per_request_us"
        wait(lambda: adapter.pod_metric(NS, metric), 120, what=f"custom metric {metric}")
        # the dedicated model's HPA scales the model (and so its pool) to 2 pods holding it
        wait(
            lambda: h.get("inferencemodel", "scaled")["spec"]["replicas"] == 2, 240, what="model scaled to 2"
        )
        wait(lambda: h.model_status("scaled").get("availableReplicas") == 2, 180, what="model on 2 pods")
        # the shared pool's HPA scales the pool to 3 pods
        wait(lambda: h.get("inferenceserver", "auto")["spec"]["replicas"] == 3, 240, what="pool scaled to 3")
        wait(
            lambda: (h.get("inferenceserver", "auto").get("status") or {}).get("readyReplicas") == 3,
            180,
            what="3 ready pool pods",
        )
        conditions = {c["type"]: c for c in h.get("inferenceserver", "auto")["status"]["conditions"]}
        assert conditions["AutoscalerReady"]["status"] == "True", conditions["AutoscalerReady"]
    except BaseException:
        adapter_log = adapter.log_path.read_text()[-3000:] if adapter.log_path.exists() else ""
        print(h.diagnostics(), f"--- adapter ---\n{adapter_log}")
        raise
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=15)
        adapter.stop()
        prometheus.stop()
        h.kubectl("-n", NS, "delete", "im", "busy", "scaled", "--timeout=90s", check=False)
        h.kubectl("-n", NS, "delete", "inferenceserver", "auto", "--timeout=90s", check=False)


# --- the guarded control API and TLS ----------------------------------------------------------------------------

OUTSIDER = r"""
import json, os, sys
import numpy as np, requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

ip = os.environ["SERVER_IP"]
base = f"http://{ip}:8000"
out = {}
for name, path, body in [
    ("http load", "/v2/repository/models/add_sub/load", {}),
    ("http unload", "/v2/repository/models/add_sub/unload", {}),
    ("http index", "/v2/repository/index", {}),
    ("http shm register", "/v2/systemsharedmemory/region/r/register", {"key": "/r", "offset": 0, "byte_size": 16}),
    ("http logging", "/v2/logging", {"log_verbose_level": 1}),
]:
    r = requests.post(base + path, json=body, timeout=10)
    out[name] = [r.status_code, r.text]
grpc = grpcclient.InferenceServerClient(f"{ip}:8001")
for name, call in [
    ("grpc load", lambda: grpc.load_model("add_sub")),
    ("grpc unload", lambda: grpc.unload_model("add_sub")),
    ("grpc shm register", lambda: grpc.register_system_shared_memory("r", "/r", 16)),
]:
    try:
        call()
        out[name] = ["OK", ""]
    except InferenceServerException as e:
        out[name] = [str(e.status()), e.message()]
body = {"inputs": [{"name": n, "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]} for n in ("INPUT0", "INPUT1")]}
r = requests.post(base + "/v2/models/add_sub/infer", json=body, timeout=10)
out["http infer"] = [r.status_code, r.json()["outputs"][0]["data"] if r.ok else r.text]
inputs = [grpcclient.InferInput(n, [4], "FP32") for n in ("INPUT0", "INPUT1")]
for i in inputs:
    i.set_data_from_numpy(np.array([1, 2, 3, 4], dtype=np.float32))
out["grpc infer"] = ["OK", grpc.infer("add_sub", inputs).as_numpy("OUTPUT0").tolist()]
out["ready"] = requests.get(base + "/v2/health/ready", timeout=10).status_code
print("RESULT " + json.dumps(out), flush=True)
"""


def client_pod(h: Harness, name: str, server_ip: str) -> dict:
    """A pod on the simulated node (a real local process): a client inside the cluster with no credential."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": h.cluster.runner_node_names[0],
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "client",
                    "image": "python:3.11-slim",
                    "command": [sys.executable, "-c", OUTSIDER],
                    "env": [{"name": "SERVER_IP", "value": server_ip}],
                }
            ],
        },
    }


def test_control_api_answers_only_the_operator(report):
    h = report
    h.apply(pool("guarded", replicas=1, modelRepository={"path": str(h.repo)}))
    h.apply(model("guarded-add-sub", serverRef={"name": "guarded"}, modelName="add_sub", replicas=1))
    wait(lambda: h.model_status("guarded-add-sub").get("phase") == "Available", 180, what="model Available")
    (server_pod,) = h.get("pods", selector="naiad.dev/server=guarded")["items"]
    ip = server_pod["status"]["podIP"]
    credential = h.credential()
    # the credential reaches the pod through its Secret, never through its spec (args, env values, annotations)
    assert credential not in json.dumps(server_pod)
    container = server_pod["spec"]["containers"][0]
    assert any(a.endswith("naiad-control-key=env:NAIAD_CONTROL_CREDENTIAL") for a in container["args"])
    assert h.exists("secret", "guarded-control")

    h.apply(client_pod(h, "outsider", ip))
    wait(
        lambda: h.get("pod", "outsider").get("status", {}).get("phase") in ("Succeeded", "Failed"),
        120,
        what="client pod finished",
    )
    logs = h.runner.logs(NS, "outsider")
    line = next((x for x in logs.splitlines() if x.startswith("RESULT ")), None)
    assert line, logs[-3000:]
    results = json.loads(line[len("RESULT ") :])
    for name in ("http load", "http unload", "http index", "http shm register", "http logging"):
        status, text = results[name]
        assert status == 403 and "naiad-control-key" in text, (name, results[name])
    for name in ("grpc load", "grpc unload", "grpc shm register"):
        assert results[name][0] == "StatusCode.PERMISSION_DENIED", (name, results[name])
    # inference and health stay open; the refused unloads changed nothing
    assert results["http infer"] == [200, [2.0, 4.0, 6.0, 8.0]]
    assert results["grpc infer"] == ["OK", [2.0, 4.0, 6.0, 8.0]]
    assert results["ready"] == 200
    assert h.index(ip)["add_sub"] == "READY"
    h.kubectl("-n", NS, "delete", "pod", "outsider", "--timeout=60s", check=False)


def test_credential_rotation_rolls_the_pool_onto_the_new_one(report):
    h = report
    old = h.credential()
    (before,) = h.get("pods", selector="naiad.dev/server=guarded")["items"]
    h.kubectl("-n", OPERATOR_NS, "annotate", "secret", "naiad-control-credential", "naiad.dev/rotate=now")
    wait(lambda: h.credential() != old, 60, what="a new credential")
    # the pool rolls onto it: a new pod, which the operator (with the new credential) loads and marks ready
    wait(
        lambda: (
            [p["metadata"]["uid"] for p in h.get("pods", selector="naiad.dev/server=guarded")["items"]]
            not in ([before["metadata"]["uid"]], [])
        ),
        120,
        what="the pool's pod replaced",
    )
    wait(
        lambda: (
            (s := h.model_status("guarded-add-sub")).get("phase") == "Available"
            and len(h.get("pods", selector="naiad.dev/server=guarded")["items"]) == 1
            and s
        ),
        180,
        what="model Available on the rolled pod",
    )
    (after,) = h.get("pods", selector="naiad.dev/server=guarded")["items"]
    assert after["metadata"]["uid"] != before["metadata"]["uid"]
    # the model is on the new pod, which answers the new credential (and only it: the old one is refused)
    ip = after["status"]["podIP"]
    wait(lambda: h.index(ip).get("add_sub") == "READY", 120, what="model loaded on the rolled pod")
    request = urllib.request.Request(
        f"http://{ip}:8000/v2/repository/index", data=b"{}", method="POST", headers={"naiad-control-key": old}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 403
    h.kubectl("-n", NS, "delete", "im", "guarded-add-sub", "--timeout=90s", check=False)
    h.kubectl("-n", NS, "delete", "inferenceserver", "guarded", "--timeout=90s", check=False)


def test_tls_pool_is_served_and_verified_by_the_operator(report):
    import ssl

    sys.path.insert(0, str(ROOT / "tests"))
    from pki import Pki

    h = report
    pki = Pki(h.workdir / "pki", "pool-ca")
    cert, key = pki.issue("tlspool", dns=(f"tlspool.{NS}.svc",))

    def b64(path: str) -> str:
        return base64.b64encode(Path(path).read_bytes()).decode()

    h.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "tlspool-tls"},
            "type": "kubernetes.io/tls",
            "data": {"tls.crt": b64(cert), "tls.key": b64(key), "ca.crt": b64(pki.ca)},
        }
    )
    h.apply(
        pool("tlspool", replicas=1, modelRepository={"path": str(h.repo)}, tls={"secretName": "tlspool-tls"})
    )
    h.apply(model("tls-add-sub", serverRef={"name": "tlspool"}, modelName="add_sub", replicas=1))
    # Available: the probes passed over HTTPS and the operator loaded the model over verified HTTPS
    status = wait(
        lambda: (s := h.model_status("tls-add-sub")).get("phase") == "Available" and s, 180, what="Available"
    )
    assert status["endpoint"]["http"] == f"https://tls-add-sub.{NS}.svc:8000/v2/models/add_sub"
    (pod,) = h.get("pods", selector="naiad.dev/server=tlspool")["items"]
    ip = pod["status"]["podIP"]
    context = ssl.create_default_context(cafile=pki.ca)
    for port, alpn in ((8000, "http/1.1"), (8001, "h2"), (8002, "http/1.1")):
        context.set_alpn_protocols([alpn])
        with socket.create_connection((ip, port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname=f"tlspool.{NS}.svc") as tls:
                assert tls.selected_alpn_protocol() == alpn
    with pytest.raises((OSError, http.client.HTTPException)):  # cleartext gets no HTTP answer from a TLS port
        h.index(ip)
    h.kubectl("-n", NS, "delete", "im", "tls-add-sub", "--timeout=90s", check=False)
    h.kubectl("-n", NS, "delete", "inferenceserver", "tlspool", "--timeout=90s", check=False)


class ServiceTraffic:
    """A client of one model through its Service, as kube-proxy would route it: the Service's ready endpoints
    (EndpointSlices, re-read every half second) taken in turn, `workers` requests at a time while `on` is set.
    Every answer but a correct 200 counts as a failure, and so does a request that finds no endpoint."""

    def __init__(self, h: Harness, service: str, model_name: str, workers: int = 2):
        self.h, self.service, self.model_name = h, service, model_name
        self.on = threading.Event()
        self.stop = threading.Event()
        self.ok = 0
        self.waited = 0  # answers that waited for a load on demand (X-Naiad-Load-Wait-Ms)
        self.failures: list[str] = []
        self.endpoints: list[str] = []
        self._lock = threading.Lock()
        self._turn = 0
        self._threads = [threading.Thread(target=self._refresh, daemon=True)]
        self._threads += [threading.Thread(target=self._send, daemon=True) for _ in range(workers)]

    def __enter__(self) -> ServiceTraffic:
        self.endpoints = sorted(self.h.endpoints(self.service))
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(60)

    def _refresh(self) -> None:
        while not self.stop.is_set():
            try:
                self.endpoints = sorted(self.h.endpoints(self.service))
            except (cluster_mod.ClusterError, OSError, ValueError):
                pass  # keep the last set, as kube-proxy would while the API server is slow
            self.stop.wait(0.5)

    def _send(self) -> None:
        body = json.dumps(
            {
                "inputs": [
                    {"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]},
                    {"name": "INPUT1", "shape": [4], "datatype": "FP32", "data": [1, 1, 1, 1]},
                ]
            }
        ).encode()
        while not self.stop.is_set():
            if not self.on.wait(0.2):
                continue
            endpoints = self.endpoints
            if not endpoints:
                with self._lock:
                    self.failures.append("no endpoint")
                self.stop.wait(0.1)
                continue
            with self._lock:
                self._turn += 1
                ip = endpoints[self._turn % len(endpoints)]
            try:
                connection = http.client.HTTPConnection(ip, 8000, timeout=60)
                connection.request(
                    "POST", f"/v2/models/{self.model_name}/infer", body, {"Content-Type": "application/json"}
                )
                response = connection.getresponse()
                answer = response.read()
                waited = response.getheader("X-Naiad-Load-Wait-Ms")
                connection.close()
                outputs = {o["name"]: o["data"] for o in json.loads(answer).get("outputs", [])}
                good = response.status == 200 and outputs.get("OUTPUT0") == [2.0, 3.0, 4.0, 5.0]
            except (OSError, http.client.HTTPException, ValueError) as error:
                good, answer, waited = False, str(error).encode(), None
            with self._lock:
                if good:
                    self.ok += 1
                    self.waited += waited is not None
                else:
                    self.failures.append(f"{ip}: {answer[:300]!r}")
            self.stop.wait(0.05)


def test_model_scales_to_zero_and_back_without_a_failed_request(report):
    """minReplicas: 0: idle for idleSeconds -> no copies, the Service on every pod of the pool, the next request
    served by a load on demand, the operator placing the model again; another model of the pool is called the
    whole time, and this one before, at and after zero: no request fails."""
    h = report
    keep = h.repo / "add_sub_keep"
    if not keep.exists():
        shutil.copytree(h.repo / "add_sub", keep)
        config = keep / "config.pbtxt"
        config.write_text(config.read_text().replace('name: "add_sub"', 'name: "add_sub_keep"'))
    # The models first: the pool's first pods already start with --load-on-demand (no rollout).
    h.apply(
        model(
            "lazy",
            serverRef={"name": "ondemand"},
            modelName="add_sub",
            replicas=1,
            minReplicas=0,
            idleSeconds=8,
        )
    )
    h.apply(model("steady", serverRef={"name": "ondemand"}, modelName="add_sub_keep", replicas=1))
    h.apply(pool("ondemand", replicas=2, modelRepository={"path": str(h.repo)}, resources={}))
    for name in ("lazy", "steady"):
        wait(lambda n=name: h.model_status(n).get("phase") == "Available", 180, what=f"{name} Available")
    deployment = h.get("deployment", "ondemand")
    assert "--load-on-demand" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    ips = {p["status"]["podIP"] for p in h.get("pods", selector="naiad.dev/server=ondemand")["items"]}
    assert len(ips) == 2
    with (
        ServiceTraffic(h, "lazy", "add_sub") as lazy,
        ServiceTraffic(h, "steady", "add_sub_keep", workers=1) as steady,
    ):
        steady.on.set()
        lazy.on.set()
        time.sleep(6)
        lazy.on.clear()  # idle from here
        status = wait(
            lambda: (s := h.model_status("lazy")).get("phase") == "ScaledToZero" and s,
            90,
            what="ScaledToZero",
        )
        assert (status["replicas"], status["desiredReplicas"]) == (0, 0)
        conditions = {c["type"]: c["status"] for c in status["conditions"]}
        assert conditions["ScaledToZero"] == "True" and conditions["Ready"] == "True"
        wait(lambda: all(h.index(ip).get("add_sub") != "READY" for ip in ips), 30, what="unloaded everywhere")
        wait(lambda: h.endpoints("lazy") == ips, 30, what="the Service on every on-demand pod")
        time.sleep(3)
        assert h.model_status("lazy").get("phase") == "ScaledToZero"  # nothing brought it back meanwhile
        served_before = lazy.ok
        lazy.on.set()  # the next requests: loaded on demand, then placed again
        status = wait(
            lambda: (s := h.model_status("lazy")).get("phase") == "Available" and s, 90, what="back from zero"
        )
        assert status["replicas"] >= 1
        assert {c["type"]: c["status"] for c in status["conditions"]}["ScaledToZero"] == "False"
        wait(lambda: len(h.endpoints("lazy")) == 1, 30, what="the Service back on the pod holding it")
        time.sleep(5)
        assert lazy.ok > served_before and lazy.waited >= 1
    events = h.kubectl("-n", NS, "get", "events", "--field-selector", "involvedObject.name=lazy").stdout
    assert "ScaledToZero" in events and "ScaledFromZero" in events
    print(f"lazy: {lazy.ok} ok ({lazy.waited} waited for a load); steady: {steady.ok} ok")
    assert not lazy.failures and not steady.failures, (lazy.failures[:5], steady.failures[:5])
    assert steady.ok > 0
    h.kubectl("-n", NS, "delete", "im", "lazy", "steady", "--timeout=90s", check=False)
    h.kubectl("-n", NS, "delete", "inferenceserver", "ondemand", "--timeout=90s", check=False)


def test_scale_down_routes_away_before_unloading_without_a_failed_request(report):
    """replicas 3 -> 1 on pods that stay: each leaving copy's pod loses its label first and is unloaded only once
    the model's EndpointSlices dropped it (draining.py), so a client following the Service's endpoints the whole
    time never reaches a pod that no longer has the model."""
    h = report
    h.apply(model("shrink", serverRef={"name": "shrinkpool"}, modelName="add_sub", replicas=3))
    h.apply(pool("shrinkpool", replicas=3, modelRepository={"path": str(h.repo)}, resources={}))
    wait(lambda: h.model_status("shrink").get("availableReplicas") == 3, 180, what="3 copies")
    ips = {p["status"]["podIP"] for p in h.get("pods", selector="naiad.dev/server=shrinkpool")["items"]}
    assert len(ips) == 3
    wait(lambda: h.endpoints("shrink") == ips, 60, what="the Service on the 3 pods")
    with ServiceTraffic(h, "shrink", "add_sub", workers=3) as traffic:
        traffic.on.set()
        time.sleep(4)
        served_before = traffic.ok
        h.kubectl("-n", NS, "patch", "im", "shrink", "--type=merge", "-p", '{"spec": {"replicas": 1}}')
        (kept,) = wait(lambda: (e := h.endpoints("shrink")) and len(e) == 1 and e, 60, what="1 endpoint")
        wait(
            lambda: {ip for ip in ips if h.index(ip).get("add_sub") == "READY"} == {kept},
            60,
            what="unloaded from the 2 other pods",
        )
        time.sleep(3)
    status = h.model_status("shrink")
    assert status["availableReplicas"] == 1 and status["phase"] == "Available"
    print(f"shrink: {traffic.ok} ok, {len(traffic.failures)} failed")
    assert not traffic.failures, traffic.failures[:5]
    assert traffic.ok > served_before
    h.kubectl("-n", NS, "delete", "im", "shrink", "--timeout=90s", check=False)
    h.kubectl("-n", NS, "delete", "inferenceserver", "shrinkpool", "--timeout=90s", check=False)


def test_a_pod_added_after_a_loss_gets_copies_back_without_a_failed_request(report):
    """A pool of 2 pods with 4 single-copy models, 2 each; one pod goes (the pool scaled to 1, as after a lost
    node) and the other takes all 4; a new pod arrives empty and the operator moves copies back, one per pass,
    loading the new copy before routing away from and unloading the old one, until 2 and 2. Clients of all four
    models through their Services the whole time: no request fails, and the pool stays put once balanced."""
    h = report
    names = [f"add_sub_r{i}" for i in range(4)]
    for name in names:
        target = h.repo / name
        if not target.exists():
            shutil.copytree(h.repo / "add_sub", target)
            config = target / "config.pbtxt"
            config.write_text(config.read_text().replace('name: "add_sub"', f'name: "{name}"'))
    for i, name in enumerate(names):
        h.apply(model(f"rb{i}", serverRef={"name": "rebal"}, modelName=name, replicas=1))
    h.apply(pool("rebal", replicas=2, modelRepository={"path": str(h.repo)}, resources={}))

    def held() -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for p in h.get("pods", selector="naiad.dev/server=rebal")["items"]:
            if p["metadata"].get("deletionTimestamp") or not p["status"].get("podIP"):
                continue
            index = h.index(p["status"]["podIP"])
            out[p["metadata"]["name"]] = {n for n in names if index.get(n) == "READY"}
        return out

    for i in range(4):
        wait(lambda i=i: h.model_status(f"rb{i}").get("phase") == "Available", 180, what=f"rb{i} Available")
    h.kubectl(
        "-n", NS, "patch", "inferenceserver", "rebal", "--type=merge", "-p", '{"spec": {"replicas": 1}}'
    )
    (survivor,) = wait(
        lambda: (c := held()) and len(c) == 1 and all(len(v) == 4 for v in c.values()) and c,
        180,
        what="the 4 models on the one pod left",
    )
    for i in range(4):
        wait(lambda i=i: len(h.endpoints(f"rb{i}")) == 1, 60, what=f"rb{i}'s Service on the pod left")
    traffic = [ServiceTraffic(h, f"rb{i}", name, workers=1) for i, name in enumerate(names)]
    for t in traffic:
        t.__enter__()
        t.on.set()
    try:
        h.kubectl(
            "-n", NS, "patch", "inferenceserver", "rebal", "--type=merge", "-p", '{"spec": {"replicas": 2}}'
        )
        balanced = wait(
            lambda: (c := held()) and len(c) == 2 and sorted(len(v) for v in c.values()) == [2, 2] and c,
            240,
            what="2 and 2 models on the 2 pods",
        )
        assert len(balanced[survivor]) == 2
        time.sleep(8)  # four resync periods: nothing else moves
        assert held() == balanced
    finally:
        for t in traffic:
            t.__exit__()
    print(f"rebalance: {sum(t.ok for t in traffic)} ok, {sum(len(t.failures) for t in traffic)} failed")
    for t in traffic:
        assert not t.failures, t.failures[:5]
        assert t.ok > 0
    for i in range(4):
        assert h.model_status(f"rb{i}")["availableReplicas"] == 1
    h.kubectl("-n", NS, "delete", "im", *(f"rb{i}" for i in range(4)), "--timeout=90s", check=False)
    h.kubectl("-n", NS, "delete", "inferenceserver", "rebal", "--timeout=90s", check=False)
