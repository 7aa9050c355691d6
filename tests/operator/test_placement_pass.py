"""One placement pass end to end, with in-memory stand-ins for the operator's own two clients (its Kubernetes
client and its model-control client): loads, unloads, labels, readiness gates and statuses."""

from __future__ import annotations

import copy
import json

import pytest
from operator_fakes import API, NS, FakeKube, FakeServers

from naiad_operator.config import OperatorConfig
from naiad_operator.load_backoff import LoadBackoff
from naiad_operator.naming import DEDICATED_FOR_LABEL, MODELS_READY_CONDITION, PLACEMENTS_ANNOTATION
from naiad_operator.placement_pass import reconcile_pool
from naiad_operator.pool_snapshot import PoolContext

on_session_loop = pytest.mark.asyncio(loop_scope="session")


def pod(name, ip, pool="gpu", ready=True, restarts=0, template_hash="h1"):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"naiad.dev/server": pool, "pod-template-hash": template_hash}},
        "status": {
            "podIP": ip,
            "containerStatuses": [{"name": "server", "ready": ready, "restartCount": restarts}],
        },
    }


def server(name="gpu", spec=None, labels=None):
    return {
        "apiVersion": API,
        "kind": "InferenceServer",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec or {"replicas": 3},
    }


def model(name, spec, created="2024-01-01T00:00:00Z"):
    return {
        "apiVersion": API,
        "kind": "InferenceModel",
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": spec,
    }


@pytest.fixture
def world():
    kube, servers = FakeKube(), FakeServers()
    kube.add(server())
    kube.add(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": "gpu",
                "labels": {"naiad.dev/server": "gpu"},
                "annotations": {"deployment.kubernetes.io/revision": "1"},
            },
            "status": {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3},
        }
    )
    kube.add(
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": "gpu-h1",
                "labels": {"naiad.dev/server": "gpu", "pod-template-hash": "h1"},
                "annotations": {"deployment.kubernetes.io/revision": "1"},
            },
        }
    )
    for i in range(3):
        kube.add(pod(f"gpu-{i}", f"10.0.0.{i}"))
    clock = [1000.0]
    ctx = PoolContext(
        kube=kube, control=servers, config=OperatorConfig(), backoff=LoadBackoff(30.0, clock=lambda: clock[0])
    )
    return kube, servers, ctx, clock


def labels_of(kube, name):
    return kube.obj("v1", "Pod", name)["metadata"].get("labels") or {}


def gate_of(kube, name):
    conditions = kube.obj("v1", "Pod", name).get("status", {}).get("conditions") or []
    return next((c["status"] for c in conditions if c["type"] == MODELS_READY_CONDITION), None)


def status_of(kube, kind, name):
    return kube.obj(API, kind, name).get("status") or {}


@on_session_loop
async def test_places_loads_labels_and_reports(world):
    kube, servers, ctx, _ = world
    kube.add(
        model(
            "resnet",
            {
                "serverRef": {"name": "gpu"},
                "modelName": "resnet50",
                "replicas": 2,
                "config": {"max_batch_size": 8},
            },
        )
    )
    report = await reconcile_pool(ctx, NS, "gpu")
    assert sorted(report.holders["resnet"]) == ["gpu-0", "gpu-1"]
    assert servers.loaded == {"10.0.0.0": {"resnet50": "1"}, "10.0.0.1": {"resnet50": "1"}}
    assert servers.configs[("10.0.0.0", "resnet50")] == {"max_batch_size": 8}
    assert labels_of(kube, "gpu-0")["naiad.dev/model-resnet"] == "loaded"
    assert "naiad.dev/model-resnet" not in labels_of(kube, "gpu-2")
    assert [gate_of(kube, f"gpu-{i}") for i in range(3)] == ["True", "True", "True"]
    recorded = json.loads(kube.obj("v1", "Pod", "gpu-0")["metadata"]["annotations"][PLACEMENTS_ANNOTATION])
    assert recorded["resnet"]["model"] == "resnet50"
    status = status_of(kube, "InferenceModel", "resnet")
    assert (
        status["phase"] == "Available" and status["availableReplicas"] == 2 and status["desiredReplicas"] == 2
    )
    assert [p["pod"] for p in status["placements"]] == ["gpu-0", "gpu-1"]
    assert status["selector"] == "naiad.dev/model-resnet=loaded,naiad.dev/server=gpu"
    assert status["endpoint"]["http"] == "http://resnet.ml.svc:8000/v2/models/resnet50"
    # the loads answered at once: no Loading status first, one status write
    assert [s["phase"] for k, n, s in kube.status_writes if n == "resnet"] == ["Available"]
    server_status = status_of(kube, "InferenceServer", "gpu")
    assert server_status["models"] == [{"name": "resnet", "modelName": "resnet50", "pods": 2}]
    assert server_status["readyReplicas"] == 3


@on_session_loop
async def test_slow_loads_report_loading_before_they_finish(world):
    kube, servers, ctx, _ = world
    servers.load_seconds = 0.2
    ctx.loading_status_delay = 0.05
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "replicas": 2}))
    kube.add(model("bert", {"serverRef": {"name": "gpu"}, "replicas": 1}))
    await reconcile_pool(ctx, NS, "gpu")
    for name in ("resnet", "bert"):
        assert [s["phase"] for k, n, s in kube.status_writes if n == name] == ["Loading", "Available"]
    loading = next(s for k, n, s in kube.status_writes if n == "resnet")
    assert {p["state"] for p in loading["placements"]} == {"Loading"}


@on_session_loop
async def test_a_second_pass_changes_nothing(world):
    kube, servers, ctx, _ = world
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "replicas": 2}))
    await reconcile_pool(ctx, NS, "gpu")
    before = copy.deepcopy({k: v for k, v in kube.objects.items() if k[1] == "Pod"})
    calls = len(servers.calls)
    await reconcile_pool(ctx, NS, "gpu")
    assert len(servers.calls) == calls
    assert {k: v for k, v in kube.objects.items() if k[1] == "Pod"} == before


@on_session_loop
async def test_restarted_pod_is_gated_and_reloaded(world):
    kube, servers, ctx, _ = world
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "replicas": 3}))
    await reconcile_pool(ctx, NS, "gpu")
    # the server on gpu-1 restarts: its models are gone, its restart count moves
    servers.loaded["10.0.0.1"] = {}
    kube.obj("v1", "Pod", "gpu-1")["status"]["containerStatuses"][0]["restartCount"] = 1
    patches = []
    original = kube.patch

    async def spy(api_version, kind, namespace, name, patch, **kw):
        patches.append((name, copy.deepcopy(patch)))
        return await original(api_version, kind, namespace, name, patch, **kw)

    kube.patch = spy
    await reconcile_pool(ctx, NS, "gpu")
    # first the label goes and the gate closes, then the model is reloaded and both come back
    gpu1 = [p for n, p in patches if n == "gpu-1"]
    assert gpu1[0]["metadata"]["labels"] == {"naiad.dev/model-resnet": None}
    assert gpu1[1]["status"]["conditions"][0]["status"] == "False"
    assert servers.loaded["10.0.0.1"] == {"resnet": "1"}
    assert labels_of(kube, "gpu-1")["naiad.dev/model-resnet"] == "loaded"
    assert gate_of(kube, "gpu-1") == "True"


@on_session_loop
async def test_config_change_reloads_in_place_without_unloading(world):
    kube, servers, ctx, _ = world
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "replicas": 2}))
    await reconcile_pool(ctx, NS, "gpu")
    servers.calls.clear()
    kube.obj(API, "InferenceModel", "resnet")["spec"]["version"] = 2
    await reconcile_pool(ctx, NS, "gpu")
    assert servers.calls == [("load", "10.0.0.0", "resnet"), ("load", "10.0.0.1", "resnet")]
    assert servers.loaded["10.0.0.0"] == {"resnet": "2"}
    status = status_of(kube, "InferenceModel", "resnet")
    assert status["phase"] == "Available" and {p["version"] for p in status["placements"]} == {"2"}


@on_session_loop
async def test_scale_down_and_delete_unload(world):
    kube, servers, ctx, _ = world
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "replicas": 3}))
    await reconcile_pool(ctx, NS, "gpu")
    kube.obj(API, "InferenceModel", "resnet")["spec"]["replicas"] = 1
    await reconcile_pool(ctx, NS, "gpu")
    assert sum("resnet" in m for m in servers.loaded.values()) == 1
    assert status_of(kube, "InferenceModel", "resnet")["availableReplicas"] == 1
    kube.obj(API, "InferenceModel", "resnet")["metadata"]["deletionTimestamp"] = "2024-01-02T00:00:00Z"
    report = await reconcile_pool(ctx, NS, "gpu")
    assert "resnet" not in report.holders
    assert all("resnet" not in m for m in servers.loaded.values())
    assert all("naiad.dev/model-resnet" not in labels_of(kube, f"gpu-{i}") for i in range(3))


@on_session_loop
async def test_failed_load_backs_off_and_moves_to_another_pod(world):
    kube, servers, ctx, _clock = world
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "replicas": 1}))
    servers.failing.add(("10.0.0.0", "resnet"))
    await reconcile_pool(ctx, NS, "gpu")
    status = status_of(kube, "InferenceModel", "resnet")
    assert status["phase"] == "Failed" and status["lastFailure"]["pod"] == "gpu-0"
    assert status["placements"] == [
        {"pod": "gpu-0", "state": "Failed", "ip": "10.0.0.0", "message": "failed to load 'resnet'"}
    ]
    await reconcile_pool(ctx, NS, "gpu")
    assert servers.loaded.get("10.0.0.1") == {"resnet": "1"}
    assert status_of(kube, "InferenceModel", "resnet")["phase"] == "Available"
    assert [c for c in servers.calls if c[1] == "10.0.0.0"] == [("load", "10.0.0.0", "resnet")]


@on_session_loop
async def test_a_model_failing_everywhere_stays_failed_until_a_retry_succeeds(world):
    kube, servers, ctx, clock = world
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "replicas": 1}))
    servers.failing |= {(f"10.0.0.{i}", "resnet") for i in range(3)}
    for _ in range(4):  # every pod fails once, then every pod waits out its back-off
        await reconcile_pool(ctx, NS, "gpu")
        status = status_of(kube, "InferenceModel", "resnet")
        assert status["phase"] == "Failed"
        assert {c["type"]: c["reason"] for c in status["conditions"]}["Loaded"] == "LoadFailed"
    assert len([c for c in servers.calls if c[0] == "load"]) == 3
    servers.failing.clear()
    clock[0] += 1000  # the back-off passes
    await reconcile_pool(ctx, NS, "gpu")
    assert status_of(kube, "InferenceModel", "resnet")["phase"] == "Available"


@on_session_loop
async def test_unreachable_and_unready_pods_are_left_alone(world):
    kube, servers, ctx, _ = world
    servers.down.add("10.0.0.0")
    kube.obj("v1", "Pod", "gpu-1")["status"]["containerStatuses"][0]["ready"] = False
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "replicas": 2}))
    await reconcile_pool(ctx, NS, "gpu")
    assert set(servers.loaded) == {"10.0.0.2"}
    assert gate_of(kube, "gpu-0") is None and gate_of(kube, "gpu-1") is None
    status = status_of(kube, "InferenceModel", "resnet")
    assert status["phase"] == "PartiallyAvailable"
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Scheduled"] == "InsufficientCapacity"


@on_session_loop
async def test_missing_pool_and_invalid_models_are_reported(world):
    kube, servers, ctx, _ = world
    kube.add(model("orphan", {"serverRef": {"name": "nowhere"}}))
    await reconcile_pool(ctx, NS, "nowhere")
    status = status_of(kube, "InferenceModel", "orphan")
    assert status["phase"] == "Pending"
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Scheduled"] == "ServerNotFound"
    kube.add(
        model("first", {"serverRef": {"name": "gpu"}, "modelName": "same"}, created="2024-01-01T00:00:00Z")
    )
    kube.add(
        model("second", {"serverRef": {"name": "gpu"}, "modelName": "same"}, created="2024-01-02T00:00:00Z")
    )
    kube.add(model("trt", {"serverRef": {"name": "gpu"}, "backend": "tensorrt"}))
    kube.obj(API, "InferenceServer", "gpu")["spec"]["capabilities"] = {"backends": ["onnxruntime"]}
    await reconcile_pool(ctx, NS, "gpu")
    assert status_of(kube, "InferenceModel", "first")["phase"] == "Available"
    second = status_of(kube, "InferenceModel", "second")
    assert second["phase"] == "Failed" and "already served" in second["conditions"][0]["message"]
    assert status_of(kube, "InferenceModel", "trt")["phase"] == "Failed"
    assert all("trt" not in m for m in servers.loaded.values())


@on_session_loop
async def test_dedicated_pool_holds_the_model_on_every_pod(world):
    kube, servers, ctx, _ = world
    kube.add(server("resnet-server", {"replicas": 2}, labels={DEDICATED_FOR_LABEL: "resnet"}))
    kube.add(pod("resnet-server-a", "10.0.1.1", pool="resnet-server"))
    kube.add(pod("resnet-server-b", "10.0.1.2", pool="resnet-server", ready=False))
    kube.add(model("resnet", {"replicas": 2}))
    await reconcile_pool(ctx, NS, "resnet-server")
    assert servers.loaded == {"10.0.1.1": {"resnet": "1"}}
    status = status_of(kube, "InferenceModel", "resnet")
    # the pool wants 2 pods; one is not ready yet
    assert status["desiredReplicas"] == 2 and status["phase"] == "PartiallyAvailable"
    kube.obj("v1", "Pod", "resnet-server-b")["status"]["containerStatuses"][0]["ready"] = True
    await reconcile_pool(ctx, NS, "resnet-server")
    assert status_of(kube, "InferenceModel", "resnet")["phase"] == "Available"


@on_session_loop
async def test_leftovers_of_deleted_models_are_unloaded(world):
    kube, servers, ctx, _ = world
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "replicas": 3}))
    await reconcile_pool(ctx, NS, "gpu")
    del kube.objects[(API, "InferenceModel", NS, "resnet")]  # deleted while the operator was away
    await reconcile_pool(ctx, NS, "gpu")
    assert all(not m for m in servers.loaded.values())
    assert all("naiad.dev/model-resnet" not in labels_of(kube, f"gpu-{i}") for i in range(3))
    recorded = json.loads(kube.obj("v1", "Pod", "gpu-0")["metadata"]["annotations"][PLACEMENTS_ANNOTATION])
    assert recorded == {}


@on_session_loop
async def test_suspend_unloads_and_resume_reloads(world):
    kube, servers, ctx, _ = world
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "replicas": 2}))
    await reconcile_pool(ctx, NS, "gpu")
    kube.obj(API, "InferenceModel", "resnet")["spec"]["suspended"] = True
    await reconcile_pool(ctx, NS, "gpu")
    assert all(not m for m in servers.loaded.values())
    assert status_of(kube, "InferenceModel", "resnet")["phase"] == "Suspended"
    kube.obj(API, "InferenceModel", "resnet")["spec"]["suspended"] = False
    await reconcile_pool(ctx, NS, "gpu")
    assert status_of(kube, "InferenceModel", "resnet")["phase"] == "Available"


def test_backoff_doubles_and_forgets_old_failures():
    clock = [0.0]
    backoff = LoadBackoff(10.0, clock=lambda: clock[0])
    backoff.failed(NS, "p", "m", "r", "boom")
    assert backoff.avoid(NS, "m", "r") == {"p": "boom"}
    clock[0] = 11
    assert backoff.avoid(NS, "m", "r") == {}
    backoff.failed(NS, "p", "m", "r", "boom again")  # second failure: 20 s
    clock[0] = 30
    assert backoff.avoid(NS, "m", "r") == {"p": "boom again"}
    backoff.succeeded(NS, "p", "m", "r")
    assert backoff.avoid(NS, "m", "r") == {}
    backoff.failed(NS, "p", "m", "old", "x")
    clock[0] = 10_000
    backoff.failed(NS, "q", "m", "new", "y")
    assert ("ml", "p", "m", "old") not in backoff._failures


@on_session_loop
async def test_a_steady_state_pass_writes_nothing(world):
    kube, servers, ctx, _ = world
    kube.add(model("resnet", {"serverRef": {"name": "gpu"}, "modelName": "resnet50", "replicas": 2}))
    await reconcile_pool(ctx, NS, "gpu")
    await reconcile_pool(ctx, NS, "gpu")  # the first pass's writes settle (gates, pool status)
    writes, pods = (
        len(kube.status_writes),
        copy.deepcopy([kube.obj("v1", "Pod", f"gpu-{i}") for i in range(3)]),
    )
    await reconcile_pool(ctx, NS, "gpu")
    assert len(kube.status_writes) == writes
    assert [kube.obj("v1", "Pod", f"gpu-{i}") for i in range(3)] == pods
    # models come from the operator's index when it has one, not from a list of every InferenceModel
    only_indexed = model("bert", {"serverRef": {"name": "gpu"}, "modelName": "bert", "replicas": 1})
    ctx.models = lambda namespace, pool: [copy.deepcopy(only_indexed)] if pool == "gpu" else []
    await reconcile_pool(ctx, NS, "gpu")
    assert sum("bert" in models for models in servers.loaded.values()) == 1
