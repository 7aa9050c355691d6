"""Route first, unload after: a copy leaving a pod that stays loses the pod's label in one pass and is unloaded in a
later one, once the model's EndpointSlices dropped the pod (or the unload delay passed)."""

from __future__ import annotations

import asyncio
import json

import pytest
from operator_fakes import API, NS, FakeKube, FakeServers

from naiad_operator.config import OperatorConfig
from naiad_operator.draining import DrainBook
from naiad_operator.endpoint_slices import routed_endpoints
from naiad_operator.kube import KubeError
from naiad_operator.load_backoff import LoadBackoff
from naiad_operator.naming import PLACEMENTS_ANNOTATION
from naiad_operator.placement_pass import reconcile_pool
from naiad_operator.pool_snapshot import PoolContext
from naiad_operator.runner import PassRunner

on_session_loop = pytest.mark.asyncio(loop_scope="session")
LABEL = "naiad.dev/model-resnet"


def pod(name, ip):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"naiad.dev/server": "gpu", "pod-template-hash": "h1"}},
        "status": {"podIP": ip, "containerStatuses": [{"name": "server", "ready": True, "restartCount": 0}]},
    }


class Cluster(FakeKube):
    """FakeKube whose EndpointSlices follow the model label of the pods at once, or never (`frozen`), or cannot
    be read (`forbidden`)."""

    def __init__(self):
        super().__init__()
        self.frozen: set[str] | None = None
        self.forbidden = False
        self.endpoint_reads = 0

    async def list(self, api_version, kind, namespace, label_selector=None):
        if kind != "EndpointSlice":
            return await super().list(api_version, kind, namespace, label_selector)
        self.endpoint_reads += 1
        if self.forbidden:
            raise KubeError(403, "Forbidden", "endpointslices is forbidden")
        service = label_selector.split("=", 1)[1]
        if service != "resnet":
            return []
        pods = [
            b for (av, k, _, _), b in self.objects.items() if k == "Pod" and LABEL in b["metadata"]["labels"]
        ]
        names = {b["metadata"]["name"] for b in pods} if self.frozen is None else self.frozen
        endpoints = [
            {
                "addresses": [b["status"]["podIP"]],
                "conditions": {"ready": True},
                "targetRef": {"kind": "Pod", "name": b["metadata"]["name"]},
            }
            for (_, k, _, _), b in sorted(self.objects.items())
            if k == "Pod" and b["metadata"]["name"] in names
        ]
        return [{"metadata": {"labels": {"kubernetes.io/service-name": service}}, "endpoints": endpoints}]


@pytest.fixture
def world():
    kube, servers = Cluster(), FakeServers()
    kube.add(
        {"apiVersion": API, "kind": "InferenceServer", "metadata": {"name": "gpu"}, "spec": {"replicas": 3}}
    )
    for i in range(3):
        kube.add(pod(f"gpu-{i}", f"10.0.0.{i}"))
    kube.add(
        {
            "apiVersion": API,
            "kind": "InferenceModel",
            "metadata": {"name": "resnet", "creationTimestamp": "2024-01-01T00:00:00Z"},
            "spec": {"serverRef": {"name": "gpu"}, "replicas": 3},
        }
    )
    clock = [1000.0]
    ctx = PoolContext(
        kube=kube,
        control=servers,
        config=OperatorConfig(),
        backoff=LoadBackoff(30.0),
        drain=DrainBook(5.0, settle=1.0, clock=lambda: clock[0]),
    )
    return kube, servers, ctx, clock


def labelled(kube):
    return {f"gpu-{i}" for i in range(3) if LABEL in kube.obj("v1", "Pod", f"gpu-{i}")["metadata"]["labels"]}


def holding(servers):
    return {ip for ip, models in servers.loaded.items() if "resnet" in models}


def unloads(servers):
    return [c for c in servers.calls if c[0] == "unload"]


def scale(kube, replicas):
    kube.obj(API, "InferenceModel", "resnet")["spec"]["replicas"] = replicas


@on_session_loop
async def test_scale_down_removes_the_label_first_and_unloads_after_the_endpoints_drop(world):
    kube, servers, ctx, clock = world
    await reconcile_pool(ctx, NS, "gpu")
    assert labelled(kube) == {"gpu-0", "gpu-1", "gpu-2"}
    scale(kube, 1)
    kube.frozen = {"gpu-0", "gpu-1", "gpu-2"}  # the EndpointSlice controller has not caught up yet
    report = await reconcile_pool(ctx, NS, "gpu")
    assert labelled(kube) == {"gpu-0"}  # routing goes first ...
    assert unloads(servers) == [] and len(holding(servers)) == 3  # ... the copies stay, still serving
    assert report.draining == {"resnet": ["gpu-1", "gpu-2"]} and report.recheck_in == 0.5
    recorded = json.loads(kube.obj("v1", "Pod", "gpu-1")["metadata"]["annotations"][PLACEMENTS_ANNOTATION])
    assert "resnet" in recorded  # still held, so a restarted operator finds and finishes it
    status = kube.obj(API, "InferenceModel", "resnet")["status"]
    assert status["availableReplicas"] == 1
    assert {p["pod"]: p["state"] for p in status["placements"]} == {
        "gpu-0": "Loaded",
        "gpu-1": "Unloading",
        "gpu-2": "Unloading",
    }
    clock[0] += 2
    await reconcile_pool(ctx, NS, "gpu")
    assert unloads(servers) == []  # the endpoints still list the pods
    kube.frozen = None  # the endpoints follow the labels now
    await reconcile_pool(ctx, NS, "gpu")
    assert unloads(servers) == []  # seen dropped only now: kube-proxy gets a moment to notice too
    clock[0] += 1
    report = await reconcile_pool(ctx, NS, "gpu")
    assert holding(servers) == {"10.0.0.0"} and len(unloads(servers)) == 2
    assert report.draining == {} and report.recheck_in is None
    assert report.holders == {"resnet": ["gpu-0"]}
    assert labelled(kube) == {"gpu-0"}


@on_session_loop
async def test_a_moving_copy_keeps_its_old_pod_routed_until_the_new_one_is_listed(world):
    """A copy moved to an emptier pod (placement's rebalancing): the new copy is loaded and labelled first, and the
    old pod keeps its label, so the Service always has an endpoint, until the endpoints list the new pod; then
    the old copy drains as any surplus copy does, and the new one is the copy kept."""
    kube, servers, ctx, clock = world
    scale(kube, 1)
    await reconcile_pool(ctx, NS, "gpu")
    assert labelled(kube) == {"gpu-0"} and holding(servers) == {"10.0.0.0"}
    servers.loaded["10.0.0.0"].update({"other_a": "1", "other_b": "1"})  # gpu-0 fills up with others' models
    kube.frozen = {"gpu-0"}  # the EndpointSlice controller has not caught up with gpu-1's label yet
    await reconcile_pool(ctx, NS, "gpu")
    assert holding(servers) == {"10.0.0.0", "10.0.0.1"} and unloads(servers) == []
    assert labelled(kube) == {"gpu-0", "gpu-1"}  # the old pod still routed: the Service is never empty
    clock[0] += 10
    await reconcile_pool(ctx, NS, "gpu")
    assert (
        labelled(kube) == {"gpu-0", "gpu-1"} and unloads(servers) == []
    )  # still waiting for gpu-1 to be listed
    kube.frozen = {"gpu-0", "gpu-1"}  # gpu-1 is in the endpoints now
    await reconcile_pool(ctx, NS, "gpu")
    assert labelled(kube) == {"gpu-1"} and unloads(servers) == []  # routing leaves gpu-0 first ...
    kube.frozen = None
    await reconcile_pool(ctx, NS, "gpu")
    clock[0] += 1
    await reconcile_pool(ctx, NS, "gpu")
    assert holding(servers) == {"10.0.0.1"} and unloads(servers) == [("unload", "10.0.0.0", "resnet")]
    assert labelled(kube) == {"gpu-1"}
    await reconcile_pool(ctx, NS, "gpu")  # and it stays there
    assert holding(servers) == {"10.0.0.1"} and len([c for c in servers.calls if c[0] == "load"]) == 2


@on_session_loop
async def test_unreadable_endpoints_wait_for_the_unload_delay(world):
    kube, servers, ctx, clock = world
    await reconcile_pool(ctx, NS, "gpu")
    scale(kube, 2)
    kube.forbidden = True
    await reconcile_pool(ctx, NS, "gpu")
    assert labelled(kube) == {"gpu-0", "gpu-1"}
    clock[0] += 4.9
    await reconcile_pool(ctx, NS, "gpu")
    assert unloads(servers) == []
    clock[0] += 0.2
    await reconcile_pool(ctx, NS, "gpu")
    assert unloads(servers) == [("unload", "10.0.0.2", "resnet")]


@on_session_loop
async def test_endpoints_that_never_drop_the_pod_are_waited_for_at_most_the_delay(world):
    kube, servers, ctx, clock = world
    await reconcile_pool(ctx, NS, "gpu")
    scale(kube, 2)
    kube.frozen = {"gpu-0", "gpu-1", "gpu-2"}
    await reconcile_pool(ctx, NS, "gpu")
    clock[0] += 5
    await reconcile_pool(ctx, NS, "gpu")
    assert unloads(servers) == [("unload", "10.0.0.2", "resnet")]


@on_session_loop
async def test_scaling_back_up_while_draining_keeps_the_copy_and_routes_it_again(world):
    kube, servers, ctx, clock = world
    await reconcile_pool(ctx, NS, "gpu")
    scale(kube, 1)
    await reconcile_pool(ctx, NS, "gpu")
    assert labelled(kube) == {"gpu-0"}
    scale(kube, 3)
    report = await reconcile_pool(ctx, NS, "gpu")
    assert labelled(kube) == {"gpu-0", "gpu-1", "gpu-2"}
    assert report.draining == {} and report.recheck_in is None
    clock[0] += 10
    await reconcile_pool(ctx, NS, "gpu")
    assert unloads(servers) == [] and [c for c in servers.calls if c[0] == "load"] == [
        ("load", f"10.0.0.{i}", "resnet") for i in range(3)
    ]


@on_session_loop
async def test_a_draining_copy_is_not_kept_instead_of_a_routed_one(world):
    """With two pending copies and one routed copy, scaling 1 -> 2 keeps the routed copy and takes back one of the
    draining copies (no new load), and the other goes on draining."""
    kube, servers, ctx, _ = world
    await reconcile_pool(ctx, NS, "gpu")
    scale(kube, 1)
    await reconcile_pool(ctx, NS, "gpu")
    scale(kube, 2)
    report = await reconcile_pool(ctx, NS, "gpu")
    assert labelled(kube) == {"gpu-0", "gpu-1"}
    assert report.draining == {"resnet": ["gpu-2"]}
    assert len([c for c in servers.calls if c[0] == "load"]) == 3


@on_session_loop
async def test_deleting_a_model_unroutes_every_copy_before_unloading(world):
    kube, servers, ctx, clock = world
    await reconcile_pool(ctx, NS, "gpu")
    kube.obj(API, "InferenceModel", "resnet")["metadata"]["deletionTimestamp"] = "2024-01-02T00:00:00Z"
    report = await reconcile_pool(ctx, NS, "gpu")
    assert labelled(kube) == set() and unloads(servers) == []
    assert sorted(report.holders["resnet"]) == sorted(report.draining["resnet"])
    await reconcile_pool(ctx, NS, "gpu")
    clock[0] += 1
    report = await reconcile_pool(ctx, NS, "gpu")
    assert holding(servers) == set() and "resnet" not in report.holders


@on_session_loop
async def test_a_deleted_models_leftovers_are_unrouted_before_they_are_unloaded(world):
    kube, servers, ctx, clock = world
    await reconcile_pool(ctx, NS, "gpu")
    del kube.objects[(API, "InferenceModel", NS, "resnet")]
    await reconcile_pool(ctx, NS, "gpu")
    assert labelled(kube) == set() and unloads(servers) == []
    await reconcile_pool(ctx, NS, "gpu")
    clock[0] += 1
    await reconcile_pool(ctx, NS, "gpu")
    assert holding(servers) == set()
    recorded = json.loads(kube.obj("v1", "Pod", "gpu-0")["metadata"]["annotations"][PLACEMENTS_ANNOTATION])
    assert recorded == {}


def test_routed_endpoints_skip_endpoints_that_receive_no_traffic():
    slices = [
        {
            "endpoints": [
                {
                    "addresses": ["10.0.0.1"],
                    "conditions": {"ready": True},
                    "targetRef": {"kind": "Pod", "name": "a"},
                },
                {
                    "addresses": ["10.0.0.2"],
                    "conditions": {"ready": False},
                    "targetRef": {"kind": "Pod", "name": "b"},
                },
                {"addresses": ["10.0.0.3"], "conditions": {"ready": False, "serving": True}},
                {"addresses": ["10.0.0.4"]},
            ]
        },
        {"endpoints": None},
    ]
    assert routed_endpoints(slices) == {"a", "10.0.0.1", "10.0.0.3", "10.0.0.4"}


@on_session_loop
async def test_the_pass_runner_runs_the_follow_up_a_pass_asks_for():
    passes = []

    async def run(namespace, pool):
        passes.append(pool)
        return 0.01 if len(passes) < 3 else None

    runner = PassRunner(run, again=lambda delay: delay)
    await runner.run("ns", "gpu")
    for _ in range(100):
        if len(passes) >= 3:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert passes == ["gpu"] * 3  # two follow-ups, then none once nothing is pending
    await runner.close()
