"""The operator in production, against the real control plane (see test_operator_cluster.py): two replicas with
leader election over a Lease, the leader killed during a scale-out, serving without any operator,
PodDisruptionBudgets enforced by the API server's eviction subresource, on two GPU nodes, and a canary placed,
measured per variant, rolled back and promoted.

Slow (a cluster start, about a minute, then a few minutes of scenarios).
Run: pytest tests/operator/test_operator_ha_cluster.py -m slow
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from test_operator_cluster import NS, OPERATOR_NS, _env, model, pool, running_cluster, wait

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LEASE = "naiad"  # the chart's Lease name: the release's full name
# The chart's defaults: lease duration, renew deadline, retry period.
LEASE_SECONDS, RETRY_SECONDS = 10.0, 2.0


class Replica:
    """One operator process with leader election on, as the chart runs it."""

    def __init__(self, h, name: str):
        from test_operator_cluster import free_port

        self.name = name
        self.port = free_port()
        self.log = h.workdir / f"operator-{name}.log"
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "naiad_operator",
                    "--namespace",
                    NS,
                    f"--liveness=http://127.0.0.1:{self.port}/healthz",
                    "--leader-elect",
                    f"--leader-elect-namespace={OPERATOR_NS}",
                    f"--leader-elect-lease={LEASE}",
                    "--verbose",
                ],
                env=_env(
                    KUBECONFIG=h.operator_kubeconfig(),
                    NAIAD_RESYNC_SECONDS="2",
                    NAIAD_LOAD_RETRY_SECONDS="2",
                    NAIAD_SERVER_IMAGE="naiad-server:it",
                    HOSTNAME=f"operator-{name}",
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=h.workdir,
            )

    def health(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=5) as response:
            return json.loads(response.read())

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    # The chart's defaults: two replicas, leader election on (the Role for the Lease is what the replicas use).
    with running_cluster(tmp_path_factory.mktemp("naiad-ha"), nodes=2, operator=False) as h:
        shutil.copytree(h.repo / "add_sub" / "1", h.repo / "add_sub" / "2")  # a second version for canaries
        h.replicas = []
        yield h
        for replica in h.replicas:
            replica.stop()


@pytest.fixture
def report(ha, request):
    failed_before = request.session.testsfailed
    yield ha
    if request.session.testsfailed > failed_before:
        print(ha.diagnostics())
        for replica in ha.replicas:
            print(f"--- operator {replica.name} ---\n{replica.log.read_text()[-6000:]}")


def holder(h) -> str | None:
    lease = json.loads(h.kubectl("-n", OPERATOR_NS, "get", "lease", LEASE, "-o", "json").stdout)
    return lease["spec"].get("holderIdentity")


def start(h, name: str) -> Replica:
    replica = Replica(h, name)
    h.replicas.append(replica)
    wait(lambda: replica.health(), 60, what=f"operator {name} liveness")
    return replica


def ensure_leader(h) -> None:
    """A leading replica (started here when this test runs alone)."""
    if not any(r.process.poll() is None for r in h.replicas):
        start(h, f"r{len(h.replicas)}")
    wait(lambda: leader_of(h, h.replicas), 30, what="a leader")


def leader_of(h, replicas: list[Replica]) -> Replica | None:
    for replica in replicas:
        if replica.process.poll() is None and replica.health().get("leader"):
            return replica
    return None


class ReadinessWatch:
    """Polls the pool's pods; records every pod that was Ready and then became unready while not terminating."""

    def __init__(self, h, selector: str):
        self.h, self.selector = h, selector
        self.ever_ready: set[str] = set()
        self.dropped: list[tuple[str, float]] = []
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                pods = self.h.get("pods", selector=self.selector)["items"]
            except Exception:  # a failed poll is not a finding
                time.sleep(0.3)
                continue
            for p in pods:
                name = p["metadata"]["name"]
                ready = any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in p["status"].get("conditions") or []
                )
                if ready:
                    self.ever_ready.add(name)
                elif name in self.ever_ready and not p["metadata"].get("deletionTimestamp"):
                    self.dropped.append((name, time.time()))
            time.sleep(0.3)

    def __enter__(self) -> ReadinessWatch:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop_flag.set()
        self.thread.join(10)


def ready_pods(h, selector: str) -> list[dict]:
    return [
        p
        for p in h.get("pods", selector=selector)["items"]
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
    ]


def dedicated(h, name: str, replicas: int, **extra) -> dict:
    return model(
        name,
        modelName="add_sub",
        replicas=replicas,
        storage={"uri": f"file://{h.repo}"},
        server={
            "resources": {"limits": {"nvidia.com/gpu": 1}},
            "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}],
            **extra,
        },
    )


def test_leader_killed_during_a_scale_out_hands_over_and_leaves_no_pod_unready(report):
    h = report
    first = start(h, "a")
    wait(lambda: first.health()["leader"], 30, what="first replica leads")
    second = start(h, "b")
    assert holder(h) == first.health()["identity"]
    time.sleep(2 * RETRY_SECONDS)
    assert second.health()["leader"] is False  # a standby does not reconcile

    h.apply(dedicated(h, "ha", 2))
    selector = "naiad.dev/server=ha-server"
    wait(lambda: h.model_status("ha").get("availableReplicas") == 2, 180, what="ha on 2 pods")
    before = {p["metadata"]["name"] for p in ready_pods(h, selector)}
    assert len(before) == 2
    # Both copies on different nodes (the pool's default topology spread; two GPU nodes here).
    nodes = {p["spec"]["nodeName"] for p in ready_pods(h, selector)}
    assert len(nodes) == 2, nodes

    with ReadinessWatch(h, selector) as watch:
        h.kubectl("-n", NS, "scale", "im", "ha", "--replicas=4")
        # Kill the leader as the new pods come up: no release, the standby waits out the lease.
        wait(lambda: len(h.get("pods", selector=selector)["items"]) == 4, 60, what="4 pods created")
        killed = time.monotonic()
        first.stop(signal.SIGKILL)
        wait(lambda: second.health()["leader"], LEASE_SECONDS + 10, interval=0.2, what="standby leads")
        handover = time.monotonic() - killed
        print(
            f"\nhand-over after SIGKILL of the leader: {handover:.1f}s (lease duration {LEASE_SECONDS:.0f}s)"
        )
        assert handover < LEASE_SECONDS + 3 * RETRY_SECONDS + 2
        assert holder(h) == second.health()["identity"]
        # The new leader finishes the scale-out: every pod holds the model and is Ready.
        wait(lambda: h.model_status("ha").get("availableReplicas") == 4, 120, what="ha on 4 pods")
        wait(lambda: len(ready_pods(h, selector)) == 4, 60, what="4 Ready pods")
        time.sleep(1)
    assert watch.dropped == [], f"pods went unready: {watch.dropped}"
    assert before <= watch.ever_ready
    for p in ready_pods(h, selector):
        assert h.infer(p["status"]["podIP"]) == [2.0, 3.0, 4.0, 5.0]

    # A leader that stops cleanly releases the Lease: a standby takes over within about a retry period.
    third = start(h, "c")
    time.sleep(2 * RETRY_SECONDS)
    assert third.health()["leader"] is False
    stopped = time.monotonic()
    second.stop(signal.SIGTERM)
    wait(lambda: third.health()["leader"], 15, interval=0.1, what="standby leads after a release")
    graceful = time.monotonic() - stopped
    print(f"hand-over after SIGTERM of the leader: {graceful:.1f}s")
    assert graceful < 3 * RETRY_SECONDS + 3

    # Without any operator at all, pods that hold their models stay Ready and keep serving.
    third.stop(signal.SIGKILL)
    with ReadinessWatch(h, selector) as watch:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for p in ready_pods(h, selector):
                assert h.infer(p["status"]["podIP"]) == [2.0, 3.0, 4.0, 5.0]
            time.sleep(1)
    assert watch.dropped == [] and len(watch.ever_ready) == 4
    start(h, "d")


def evict(h, name: str) -> subprocess.CompletedProcess:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": NS}}
    return h.cluster.kubectl(
        "create", "--raw", f"/api/v1/namespaces/{NS}/pods/{name}/eviction", "-f", "-",
        input=json.dumps(body), check=False,
    )  # fmt: skip


def test_pool_disruption_budget_is_created_and_enforced_by_eviction(report):
    h = report
    ensure_leader(h)
    h.apply(
        pool(
            "guarded",
            replicas=3,
            modelRepository={"path": str(h.repo)},
            disruptionBudget={"maxUnavailable": 1},
        )
    )
    h.apply(model("guarded-m", serverRef={"name": "guarded"}, modelName="add_sub", replicas=2))
    budget = wait(lambda: h.get("pdb", "guarded"), 60, what="PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == {"matchLabels": {"naiad.dev/server": "guarded"}}
    assert budget["metadata"]["ownerReferences"][0]["kind"] == "InferenceServer"
    wait(lambda: h.model_status("guarded-m").get("availableReplicas") == 2, 180, what="guarded-m Available")
    selector = "naiad.dev/server=guarded"

    def holder_nodes() -> set:
        holders = h.get("pods", selector=f"{selector},naiad.dev/model-guarded-m=loaded")["items"]
        return {p["spec"]["nodeName"] for p in holders}

    # The model's two copies end up on different nodes. Pods become ready one at a time, so both copies may
    # first land on one node; placement then moves one to the other node's pod once it is ready (_respread).
    wait(lambda: len(holder_nodes()) == 2, 120, what="guarded-m's copies on two nodes")
    wait(
        lambda: (h.get("pdb", "guarded").get("status") or {}).get("disruptionsAllowed") == 1,
        60,
        what="PDB allows one disruption",
    )
    first, second = (p["metadata"]["name"] for p in ready_pods(h, selector)[:2])
    allowed = evict(h, first)
    assert allowed.returncode == 0, allowed.stderr
    refused = evict(h, second)
    assert refused.returncode != 0
    assert "disruption budget" in refused.stderr, refused.stderr
    # Once the replacement pod is Ready (its models loaded), the budget allows a disruption again.
    wait(lambda: len(ready_pods(h, selector)) == 3, 120, what="replacement Ready")
    wait(
        lambda: (h.get("pdb", "guarded").get("status") or {}).get("disruptionsAllowed") == 1,
        60,
        what="PDB allows one disruption again",
    )
    assert evict(h, second).returncode == 0
    wait(lambda: h.model_status("guarded-m").get("availableReplicas") == 2, 120, what="guarded-m back to 2")
    # Turning the budget off removes it.
    h.kubectl(
        "-n", NS, "patch", "inferenceserver", "guarded", "--type=merge",
        "-p", json.dumps({"spec": {"disruptionBudget": {"enabled": False}}}),
    )  # fmt: skip
    wait(lambda: not h.exists("pdb", "guarded"), 60, what="PDB removed")
    h.kubectl("-n", NS, "delete", "im", "guarded-m", "--timeout=90s")
    h.kubectl("-n", NS, "delete", "inferenceserver", "guarded", "--timeout=90s")


ADD_SUB = {
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


def post(ip: str, path: str, body: dict | None = None, credential: str | None = None) -> dict | list:
    headers = {"Content-Type": "application/json"}
    if (
        credential is not None
    ):  # the control APIs (repository index, load, unload) answer only the operator's key
        headers["naiad-control-key"] = credential
    request = urllib.request.Request(
        f"http://{ip}:8000{path}", data=json.dumps(body or {}).encode(), method="POST", headers=headers
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def versions_ready(ip: str, credential: str) -> list[str]:
    index = post(ip, "/v2/repository/index", credential=credential)
    return sorted(e["version"] for e in index if e.get("state") == "READY")


def served(h, selector: str) -> dict[str, list[str]]:
    """Pod IP -> versions of add_sub READY there, for the pods holding the model."""
    credential = h.credential()
    return {
        p["status"]["podIP"]: versions_ready(p["status"]["podIP"], credential)
        for p in h.get("pods", selector=selector)["items"]
    }


def success_count(ip: str, version: str) -> int:
    with urllib.request.urlopen(
        f"http://{ip}:8000/v2/models/add_sub/versions/{version}/stats", timeout=5
    ) as r:
        return json.loads(r.read())["model_stats"][0]["inference_stats"]["success"]["count"]


def variants(h, name: str) -> dict[str, dict]:
    return {v["name"]: v for v in h.model_status(name).get("variants") or []}


def test_canary_placement_traffic_rollback_and_promotion(report):
    h = report
    ensure_leader(h)
    h.apply(pool("cpool", replicas=4, modelRepository={"path": str(h.repo)}))
    # A load's config override replaces config.pbtxt (as in Triton), so the model brings its whole config.
    h.apply(
        model("cm", serverRef={"name": "cpool"}, modelName="add_sub", replicas=4, version=1, config=ADD_SUB)
    )
    wait(lambda: h.model_status("cm").get("availableReplicas") == 4, 180, what="cm on 4 pods")
    holders = "naiad.dev/server=cpool,naiad.dev/model-cm=loaded"
    assert sorted(served(h, holders).values()) == [["1"]] * 4

    def patch(body) -> None:
        kind = "json" if isinstance(body, list) else "merge"
        h.kubectl("-n", NS, "patch", "im", "cm", f"--type={kind}", "-p", json.dumps(body))

    # Placement: version 2 on a quarter of the pods; the model's Service still selects all four.
    patch({"spec": {"canary": {"version": 2, "trafficPercent": 25}}})
    wait(
        lambda: sorted(served(h, holders).values()) == [["1"]] * 3 + [["2"]], 120, what="canary on 1 pod of 4"
    )
    wait(lambda: variants(h, "cm").get("canary", {}).get("replicas") == 1, 60, what="status.variants")
    assert variants(h, "cm")["stable"]["replicas"] == 3 and variants(h, "cm")["canary"]["version"] == "2"
    wait(lambda: len(h.endpoints("cm")) == 4, 60, what="Service selects both variants")

    # Traffic counted per variant: 10 requests to each endpoint of the model's Service.
    before = {v: variants(h, "cm")[v].get("requests", 0) for v in ("stable", "canary")}
    for ip in h.endpoints("cm"):
        for _ in range(10):
            assert h.infer(ip) == [2.0, 3.0, 4.0, 5.0]
    wait(
        lambda: (
            variants(h, "cm")["stable"].get("requests") == before["stable"] + 30
            and variants(h, "cm")["canary"].get("requests") == before["canary"] + 10
        ),
        30,
        what="per-variant request counts",
    )
    shown = variants(h, "cm")
    print(f"\nstatus.variants: {json.dumps(list(shown.values()))}")
    assert shown["canary"]["failures"] == 0 and "requestRate" in shown["canary"]

    # Rollback: removing the canary reloads version 1 in place; status.variants goes.
    patch([{"op": "remove", "path": "/spec/canary"}])
    wait(lambda: sorted(served(h, holders).values()) == [["1"]] * 4, 120, what="rolled back")
    wait(lambda: not h.model_status("cm").get("variants"), 60, what="variants gone")
    assert h.model_status("cm")["availableReplicas"] == 4

    # Promotion: half the pods get version 2, then promote makes it the model's; the canary pods keep their
    # copy (their request counters survive: no reload), the others reload.
    patch({"spec": {"canary": {"version": 2, "trafficPercent": 50}}})
    wait(
        lambda: sorted(served(h, holders).values()) == [["1"], ["1"], ["2"], ["2"]],
        120,
        what="canary on 2 pods",
    )
    canary_ips = [ip for ip, v in served(h, holders).items() if v == ["2"]]
    for ip in canary_ips:
        h.infer(ip)
    counts = {ip: success_count(ip, "2") for ip in canary_ips}
    patch({"spec": {"canary": {"promote": True}}})
    wait(lambda: h.get("inferencemodel", "cm")["spec"].get("version") == 2, 60, what="spec.version promoted")
    assert "canary" not in h.get("inferencemodel", "cm")["spec"]
    wait(lambda: sorted(served(h, holders).values()) == [["2"]] * 4, 120, what="rolled forward")
    wait(lambda: h.model_status("cm").get("availableReplicas") == 4, 60, what="cm Available on version 2")
    for ip, count in counts.items():
        assert success_count(ip, "2") >= count
    events = h.kubectl("-n", NS, "get", "events", "--field-selector", "involvedObject.name=cm").stdout
    assert "CanaryPromoted" in events
    h.kubectl("-n", NS, "delete", "im", "cm", "--timeout=90s")
    h.kubectl("-n", NS, "delete", "inferenceserver", "cpool", "--timeout=90s")
