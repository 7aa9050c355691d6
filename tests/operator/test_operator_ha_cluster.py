"""The operator in production, against the real control plane (see test_operator_cluster.py): two replicas with
leader election over a Lease, the leader killed during a scale-out, serving without any operator, and
PodDisruptionBudgets enforced by the API server's eviction subresource, on two GPU nodes.

Slow (a cluster start, about a minute, then a few minutes of scenarios).
Run: pytest tests/operator/test_operator_ha_cluster.py -m slow
"""

from __future__ import annotations

import json
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
LEASE_SECONDS, RETRY_SECONDS = 8.0, 1.0


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
    wait(lambda: leader_of(h, h.replicas), 30, what="a leader")
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
    # The model's two copies are on different nodes.
    holders = h.get("pods", selector=f"{selector},naiad.dev/model-guarded-m=loaded")["items"]
    assert len({p["spec"]["nodeName"] for p in holders}) == 2
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
