"""OOM kills of server containers: read from the pods' container statuses, and an InferenceModel whose load died
with an OOM-killed container says so (Loaded/Ready reason OOMKilled, naming the pod, the memory limit and the
model) instead of a bare load failure."""

from __future__ import annotations

import pytest
from operator_fakes import API, NS, FakeKube, FakeServers

from naiad_operator.config import OperatorConfig
from naiad_operator.load_backoff import LoadBackoff
from naiad_operator.oom_kills import OomKill, load_oom, oom_kill, oom_kills
from naiad_operator.placement_pass import reconcile_pool
from naiad_operator.pool_snapshot import PoolContext
from naiad_operator.status import ModelObservation, model_conditions

on_session_loop = pytest.mark.asyncio(loop_scope="session")

KILLED = {"exitCode": 137, "reason": "OOMKilled", "finishedAt": "2026-01-01T00:00:05Z"}


def pod(name, ip="10.0.0.1", restarts=0, state=None, last=None, limit="512Mi", ready=True):
    status = {"name": "server", "ready": ready, "restartCount": restarts, "state": state or {"running": {}}}
    if last is not None:
        status["lastState"] = {"terminated": last}
    resources = {"limits": {"memory": limit, "nvidia.com/gpu": "1"}} if limit else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"naiad.dev/server": "gpu", "pod-template-hash": "h1"}},
        "spec": {"containers": [{"name": "sidecar"}, {"name": "server", "resources": resources}]},
        "status": {"podIP": ip, "containerStatuses": [{"name": "sidecar", "ready": True}, status]},
    }


def test_oom_kill_reads_the_server_containers_last_termination():
    kill = oom_kill(pod("gpu-0", restarts=2, last=KILLED))
    assert kill == OomKill(pod="gpu-0", restarts=2, memory_limit="512Mi", finished_at=KILLED["finishedAt"])
    # terminated right now (before the kubelet restarts it) counts as well
    assert oom_kill(pod("gpu-0", state={"terminated": KILLED})) is not None
    assert oom_kill(pod("gpu-0", last=KILLED, limit=None)).memory_limit is None


def test_other_terminations_and_other_containers_are_not_oom_kills():
    assert oom_kill(pod("gpu-0")) is None
    assert oom_kill(pod("gpu-0", restarts=1, last={"exitCode": 137, "reason": "Error"})) is None
    # the server's latest end was an ordinary one, even if an earlier one was an OOM kill (only lastState is kept)
    assert oom_kill(pod("gpu-0", state={"terminated": {"reason": "Completed"}}, last=KILLED)) is None
    sidecar_killed = pod("gpu-0")
    sidecar_killed["status"]["containerStatuses"][0]["lastState"] = {"terminated": KILLED}
    assert oom_kill(sidecar_killed) is None
    assert oom_kill({"metadata": {"name": "pending"}, "status": {}}) is None
    assert set(oom_kills([pod("a", last=KILLED), pod("b"), pod("c", last=KILLED)])) == {"a", "c"}


def test_load_oom_names_the_pod_the_limit_and_the_model():
    kills = oom_kills([pod("gpu-0", restarts=1, last=KILLED)])
    message = load_oom(kills, ["gpu-0"], "large_fp32")
    assert message is not None
    for part in (
        "gpu-0",
        "OOM-killed",
        "memory limit 512Mi",
        "large_fp32",
        "restartCount 1",
        KILLED["finishedAt"],
    ):
        assert part in message, (part, message)
    assert load_oom(kills, ["gpu-1"], "large_fp32") is None  # the failed load was elsewhere
    assert load_oom(kills, [], "large_fp32") is None
    later = {**KILLED, "finishedAt": "2026-01-01T00:09:00Z"}
    kills = oom_kills([pod("gpu-0", last=KILLED), pod("gpu-1", last=later)])
    assert "pod gpu-1:" in (load_oom(kills, ["gpu-0", "gpu-1"], "m") or "")  # the latest kill


def test_loaded_condition_prefers_the_oom_kill_to_the_bare_load_error():
    def conditions(**kw):
        observed = ModelObservation(wanted=1, holding=0, available=0, eligible_pods=1, **kw)
        out = model_conditions(problems=[], suspended=False, pool="gpu", pool_found=True, observed=observed)
        return {c["type"]: c for c in out}

    failure = {"time": "t", "pod": "gpu-0", "message": "POST ...: ServerDisconnectedError"}
    oom = conditions(failure=failure, oom_killed="pod gpu-0: OOM-killed")
    assert (oom["Loaded"]["reason"], oom["Loaded"]["message"]) == ("OOMKilled", "pod gpu-0: OOM-killed")
    assert (oom["Ready"]["status"], oom["Ready"]["reason"]) == ("False", "OOMKilled")
    assert conditions(retrying={"gpu-0": "x"}, oom_killed="m")["Loaded"]["reason"] == "OOMKilled"
    assert conditions(failure=failure)["Loaded"]["reason"] == "LoadFailed"
    # a model now loaded, or loading again, is not reported by an old kill
    assert conditions(oom_killed="m", loading=True)["Loaded"]["reason"] == "Loading"
    assert conditions(oom_killed="m")["Loaded"]["reason"] == "Unavailable"


@pytest.fixture
def world():
    kube, servers = FakeKube(), FakeServers()
    kube.add(
        {"apiVersion": API, "kind": "InferenceServer", "metadata": {"name": "gpu"}, "spec": {"replicas": 1}}
    )
    kube.add(
        {
            "apiVersion": API,
            "kind": "InferenceModel",
            "metadata": {"name": "large", "creationTimestamp": "2024-01-01T00:00:00Z"},
            "spec": {"serverRef": {"name": "gpu"}, "modelName": "large_fp32", "replicas": 1},
        }
    )
    ctx = PoolContext(kube=kube, control=servers, config=OperatorConfig(), backoff=LoadBackoff(30.0))
    return kube, servers, ctx


@on_session_loop
async def test_a_load_that_oom_kills_the_server_is_reported_on_the_model(world):
    kube, servers, ctx = world
    kube.add(pod("gpu-0", ip="10.0.0.0"))
    servers.failing.add(("10.0.0.0", "large_fp32"))  # the load's connection drops as the container dies
    await reconcile_pool(ctx, NS, "gpu")
    status = kube.obj(API, "InferenceModel", "large")["status"]
    loaded = next(c for c in status["conditions"] if c["type"] == "Loaded")
    assert loaded["reason"] == "LoadFailed"  # the pass read the pod before its container was killed

    # the kubelet reports the kill and restarts the container; the next pass (the pod changed) says why
    kube.obj("v1", "Pod", "gpu-0")["status"] = pod("gpu-0", ip="10.0.0.0", restarts=1, last=KILLED)["status"]
    await reconcile_pool(ctx, NS, "gpu")
    status = kube.obj(API, "InferenceModel", "large")["status"]
    by_type = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Failed"
    assert by_type["Loaded"]["reason"] == "OOMKilled" and by_type["Ready"]["reason"] == "OOMKilled"
    assert "pod gpu-0" in by_type["Loaded"]["message"] and "512Mi" in by_type["Loaded"]["message"]
    assert "large_fp32" in by_type["Loaded"]["message"]
    assert [c for c in servers.calls if c[0] == "load"] == [("load", "10.0.0.0", "large_fp32")]  # backing off


@on_session_loop
async def test_an_oom_kill_on_a_pod_the_model_did_not_fail_on_is_not_blamed_on_it(world):
    kube, _servers, ctx = world
    kube.add(pod("gpu-0", ip="10.0.0.0", restarts=1, last=KILLED))
    await reconcile_pool(ctx, NS, "gpu")
    status = kube.obj(API, "InferenceModel", "large")["status"]
    assert status["phase"] == "Available"
    assert all(c["reason"] != "OOMKilled" for c in status["conditions"])
