"""The kopf handlers' own logic, called as plain functions with the in-memory clients: what they apply, what
they refuse to touch, when a deletion waits, and which pod events start a pass."""

from __future__ import annotations

import kopf
import pytest
from operator_fakes import API, NS, FakeKube

from naiad_operator import handlers
from naiad_operator.applied import AppliedCache
from naiad_operator.config import OperatorConfig
from naiad_operator.load_backoff import LoadBackoff
from naiad_operator.placement_pass import PoolReport
from naiad_operator.security import CredentialStore

on_session_loop = pytest.mark.asyncio(loop_scope="session")


class Pools:
    """Records pass requests; `run` answers with a prepared report."""

    def __init__(self, report=None):
        self.requested: list[tuple[str, str]] = []
        self.report = report or PoolReport(found=True)

    def request(self, namespace, pool):
        self.requested.append((namespace, pool))

    async def run(self, namespace, pool):
        self.requested.append((namespace, pool))
        return self.report


def memo(kube, pools=None):
    m = kopf.Memo()
    m.kube = kube
    m.config = OperatorConfig(server_image="img:1")
    m.pools = pools or Pools()
    m.backoff = LoadBackoff(30)
    m.pod_fingerprints = {}
    m.credentials = CredentialStore(kube, "naiad-system")
    return m


def body(kind, name, spec, uid=None):
    return {
        "apiVersion": API,
        "kind": kind,
        "metadata": {"name": name, "namespace": NS, "uid": uid or f"uid-{name}"},
        "spec": spec,
    }


@on_session_loop
async def test_ensure_pool_applies_children_and_removes_only_its_own_hpa():
    kube = FakeKube()
    kube.apis.add("monitoring.coreos.com/v1")
    pool = body("InferenceServer", "gpu", {"replicas": 2, "maxReplicas": 4})
    assert await handlers.ensure_pool(memo(kube), pool, events=False) == []
    assert [o["kind"] for o in kube.applied] == [
        "Secret",  # the installation's control credential, created on first use
        "Secret",  # the pool's copy of it
        "Deployment",
        "Service",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
    ]
    assert kube.applied[2]["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    # autoscaling turned off: the operator's HPA goes, someone else's HPA with the same name would stay
    pool["spec"] = {"replicas": 2}
    await handlers.ensure_pool(memo(kube), pool, events=False)
    assert ("HorizontalPodAutoscaler", "gpu") in kube.deleted
    kube.deleted.clear()
    kube.add(
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "gpu", "ownerReferences": [{"uid": "someone-else"}]},
        }
    )
    await handlers.ensure_pool(memo(kube), pool, events=False)
    assert kube.deleted == []


@on_session_loop
async def test_ensure_pool_reports_invalid_specs_without_applying():
    kube = FakeKube()
    pool = body("InferenceServer", "gpu", {"args": ["--model-control-mode=poll"]})
    problems = await handlers.ensure_pool(memo(kube), pool, events=True)
    assert problems and "--model-control-mode" in problems[0]
    assert kube.applied == []


@on_session_loop
async def test_ensure_model_creates_a_dedicated_pool_and_services():
    kube = FakeKube()
    model = body(
        "InferenceModel",
        "resnet",
        {"replicas": 2, "minReplicas": 1, "maxReplicas": 3, "server": {"image": "x"}},
    )
    assert await handlers.ensure_model(memo(kube), model, events=False) == "resnet-server"
    kinds = [(o["kind"], o["metadata"]["name"]) for o in kube.applied]
    assert kinds == [
        ("InferenceServer", "resnet-server"),
        ("Service", "resnet"),
        ("Service", "resnet-headless"),
        ("HorizontalPodAutoscaler", "resnet"),
    ]


@on_session_loop
async def test_ensure_model_renders_an_inference_pool_only_where_the_api_is_served():
    kube = FakeKube()
    llm = body("InferenceModel", "llama", {"llm": {"engine": "vllm", "parallelism": {"tensor": 2}}})
    await handlers.ensure_model(memo(kube), llm, events=False)
    assert "InferencePool" not in [o["kind"] for o in kube.applied]  # no inference.networking.k8s.io here
    kube.apis.add("inference.networking.k8s.io/v1")
    await handlers.ensure_model(memo(kube), llm, events=False)
    (pool,) = [o for o in kube.applied if o["kind"] == "InferencePool"]
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    (server,) = [o for o in kube.applied if o["kind"] == "InferenceServer"][-1:]
    assert server["spec"]["resources"]["limits"]["nvidia.com/gpu"] == 2
    # turned off, then no longer an LLM: the operator's own InferencePool goes
    llm["spec"]["llm"]["inferencePool"] = {"enabled": False}
    await handlers.ensure_model(memo(kube), llm, events=False)
    assert ("InferencePool", "llama") in kube.deleted
    kube.add({**pool})
    await handlers.ensure_model(memo(kube), body("InferenceModel", "llama", {}), events=False)
    assert kube.deleted.count(("InferencePool", "llama")) == 2
    # a setting of "false" never asks
    off = memo(kube)
    off.config = OperatorConfig(server_image="img:1", inference_pools="false")
    kube.applied.clear()
    await handlers.ensure_model(
        off, body("InferenceModel", "llama", {"llm": {"engine": "vllm"}}), events=False
    )
    assert "InferencePool" not in [o["kind"] for o in kube.applied]


@on_session_loop
async def test_ensure_model_never_takes_over_a_foreign_pool():
    kube = FakeKube()
    kube.add(body("InferenceServer", "resnet-server", {"replicas": 1}, uid="other"))
    model = body("InferenceModel", "resnet", {})
    await handlers.ensure_model(memo(kube), model, events=False)
    assert "InferenceServer" not in [o["kind"] for o in kube.applied]
    assert kube.obj(API, "InferenceServer", "resnet-server")["spec"] == {"replicas": 1}


@on_session_loop
async def test_ensure_model_with_an_invalid_spec_applies_nothing():
    kube = FakeKube()
    model = body("InferenceModel", "resnet", {"serverRef": {"name": "gpu"}, "storage": {"uri": "gs://x"}})
    assert await handlers.ensure_model(memo(kube), model, events=True) == "gpu"
    assert kube.applied == []


@on_session_loop
async def test_model_delete_waits_for_unreachable_holders_then_gives_up():
    pools = Pools(PoolReport(found=True, holders={"bert": ["gpu-1"]}))
    m = memo(FakeKube(), pools)
    model = body("InferenceModel", "bert", {"serverRef": {"name": "gpu"}})
    with pytest.raises(kopf.TemporaryError, match="gpu-1"):
        await handlers.model_deleted(
            body=model, spec=model["spec"], name="bert", namespace=NS, memo=m, retry=0
        )
    await handlers.model_deleted(
        body=model, spec=model["spec"], name="bert", namespace=NS, memo=m, retry=handlers.DELETE_RETRIES
    )
    assert pools.requested == [(NS, "gpu"), (NS, "gpu")]
    # a dedicated pool is garbage-collected with the model: no pass needed
    dedicated = body("InferenceModel", "solo", {})
    await handlers.model_deleted(body=dedicated, spec={}, name="solo", namespace=NS, memo=m, retry=0)
    assert len(pools.requested) == 2


@on_session_loop
async def test_model_moving_to_another_pool_gives_both_pools_a_pass():
    pools = Pools()
    m = memo(FakeKube(), pools)
    model = body("InferenceModel", "bert", {"serverRef": {"name": "new"}})
    await handlers.model_changed(
        body=model, name="bert", namespace=NS, memo=m, old={"spec": {"serverRef": {"name": "old"}}}
    )
    assert pools.requested == [(NS, "new"), (NS, "old")]


@on_session_loop
async def test_pod_events_start_a_pass_only_when_placement_would_see_a_change():
    pools = Pools()
    m = memo(FakeKube(), pools)
    pod = {
        "metadata": {"uid": "u1", "name": "p", "labels": {"naiad.dev/server": "gpu"}},
        "status": {
            "podIP": "10.0.0.1",
            "containerStatuses": [{"name": "server", "ready": False, "restartCount": 0}],
        },
    }
    await handlers.pod_event(event={"type": "ADDED"}, body=pod, namespace=NS, memo=m)
    pod["metadata"]["labels"]["naiad.dev/model-x"] = "loaded"  # the operator's own label write
    await handlers.pod_event(event={"type": "MODIFIED"}, body=pod, namespace=NS, memo=m)
    assert len(pools.requested) == 1
    pod["status"]["containerStatuses"][0]["ready"] = True
    await handlers.pod_event(event={"type": "MODIFIED"}, body=pod, namespace=NS, memo=m)
    pod["status"]["containerStatuses"][0]["restartCount"] = 1
    await handlers.pod_event(event={"type": "MODIFIED"}, body=pod, namespace=NS, memo=m)
    await handlers.pod_event(event={"type": "DELETED"}, body=pod, namespace=NS, memo=m)
    assert pools.requested == [(NS, "gpu")] * 4
    assert m.pod_fingerprints == {}


@on_session_loop
async def test_unchanged_children_are_not_applied_again():
    kube = FakeKube()
    m = memo(kube)
    m.applied = AppliedCache()
    pool = body("InferenceServer", "gpu", {"replicas": 2})
    await handlers.ensure_pool(m, pool, events=False)
    first = len(kube.applied)
    kinds = sorted(o["kind"] for o in kube.applied)
    # the installation's control credential and the pool's copy, the Deployment, two Services, the budget
    assert kinds == ["Deployment", "PodDisruptionBudget", "Secret", "Secret", "Service", "Service"], kinds
    await handlers.ensure_pool(m, pool, events=False)
    assert len(kube.applied) == first  # a resync of an unchanged pool sends nothing
    pool["spec"]["replicas"] = 3
    await handlers.ensure_pool(m, pool, events=False)
    assert [o["kind"] for o in kube.applied[first:]] == ["Deployment"]  # only what changed


@on_session_loop
async def test_a_deleted_child_is_applied_again_from_its_watch_event():
    kube = FakeKube()
    m = memo(kube)
    m.applied = AppliedCache()
    pool = kube.add(body("InferenceServer", "gpu", {"replicas": 2}))
    await handlers.ensure_pool(m, pool, events=False)
    deployment = next(o for o in kube.applied if o["kind"] == "Deployment")
    applied = len(kube.applied)
    await handlers.child_event(event={"type": "DELETED"}, body=deployment, namespace=NS, memo=m)
    assert [o["kind"] for o in kube.applied[applied:]] == ["Deployment"]
    # an update, or a deletion because the owner is going, applies nothing
    await handlers.child_event(event={"type": "MODIFIED"}, body=deployment, namespace=NS, memo=m)
    kube.obj(API, "InferenceServer", "gpu")["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    await handlers.child_event(event={"type": "DELETED"}, body=deployment, namespace=NS, memo=m)
    assert len(kube.applied) == applied + 1


def test_models_are_indexed_by_pool():
    shared = body("InferenceModel", "bert", {"serverRef": {"name": "gpu"}})
    own = body("InferenceModel", "solo", {})
    assert list(handlers.models_by_pool(name="bert", namespace=NS, spec=shared["spec"], body=shared)) == [
        (NS, "gpu")
    ]
    assert list(handlers.models_by_pool(name="solo", namespace=NS, spec={}, body=own)) == [
        (NS, "solo-server")
    ]


@on_session_loop
async def test_a_model_that_may_scale_to_zero_starts_its_pool_with_load_on_demand():
    kube = FakeKube()
    pool = kube.add(body("InferenceServer", "gpu", {"replicas": 2}))
    lazy = body("InferenceModel", "chat", {"serverRef": {"name": "gpu"}, "minReplicas": 0})
    index: dict = {}
    m = memo(kube)
    m.pool_models = lambda namespace, name: index.get((namespace, name), [])

    def server_args():
        deployments = [o for o in kube.applied if o["kind"] == "Deployment"]
        return deployments[-1]["spec"]["template"]["spec"]["containers"][0]["args"]

    await handlers.ensure_pool(m, pool, events=False)
    assert "--load-on-demand" not in server_args()
    # the model arrives (kopf's index is updated before its handler runs): its pool is applied again at once
    index[(NS, "gpu")] = [lazy]
    await handlers.model_changed(body=lazy, name="chat", namespace=NS, memo=m, old=None)
    assert "--load-on-demand" in server_args()
    # it no longer scales to zero: the flag goes
    kept = body("InferenceModel", "chat", {"serverRef": {"name": "gpu"}, "minReplicas": 1})
    index[(NS, "gpu")] = [kept]
    await handlers.model_changed(body=kept, name="chat", namespace=NS, memo=m, old=lazy)
    assert "--load-on-demand" not in server_args()
