"""An InferenceServer with minReplicas 0: the HTTPScaledObject KEDA's HTTP add-on wakes it through, in place of the
operator's HPA, only where the cluster serves it; the pool's servers load on demand; the CRD accepts 0 for a pool
and not for a model's dedicated pool."""

from __future__ import annotations

import pytest
from operator_fakes import FakeKube
from test_crds import schema_of
from test_kopf_handlers import body, memo, on_session_loop

from naiad_operator import handlers
from naiad_operator.config import OperatorConfig
from naiad_operator.ownership import Owner
from naiad_operator.pool_resources import render_pool
from naiad_operator.pool_wake import HTTP_SCALED_OBJECT_API, MISSING_API
from naiad_operator.scale_to_zero import LOAD_ON_DEMAND_FLAG, with_load_on_demand

OWNER = Owner("naiad.dev/v1alpha1", "InferenceServer", "cpu-pool", "uid-1", "ml")
CONFIG = OperatorConfig(server_image="img:1")
ZERO = {"minReplicas": 0, "maxReplicas": 3, "replicas": 1}


def kinds(objects):
    return [o["kind"] for o in objects.apply]


def test_a_pool_at_zero_gets_an_http_scaled_object_instead_of_the_hpa():
    objects = render_pool(OWNER, ZERO, CONFIG, False, wake_api=True)
    assert "HorizontalPodAutoscaler" not in kinds(objects)
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "cpu-pool") in objects.absent
    (so,) = [o for o in objects.apply if o["kind"] == "HTTPScaledObject"]
    assert so["apiVersion"] == HTTP_SCALED_OBJECT_API and so["metadata"]["name"] == "cpu-pool"
    assert so["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "naiad.dev/v1alpha1",
        "kind": "InferenceServer",  # its scale subresource: the operator renders the Deployment from it
        "name": "cpu-pool",
        "service": "cpu-pool-headless",
        "port": 8000,
    }
    assert spec["hosts"] == ["cpu-pool", "cpu-pool.ml", "cpu-pool.ml.svc", "cpu-pool.ml.svc.cluster.local"]
    assert spec["replicas"] == {"min": 0, "max": 3}
    assert spec["scaledownPeriod"] == 300
    assert spec["timeouts"] == {"conditionWait": "300s", "responseHeader": "300s"}
    assert spec["scalingMetric"] == {"concurrency": {"targetValue": 100}}
    custom = render_pool(
        OWNER,
        {
            "minReplicas": 0,
            "scaleToZero": {
                "hosts": ["models.example.com"],
                "idleSeconds": 60,
                "startTimeoutSeconds": 90,
                "responseTimeoutSeconds": 30,
                "targetConcurrency": 8,
            },
        },
        CONFIG,
        False,
        wake_api=True,
    )
    (so,) = [o for o in custom.apply if o["kind"] == "HTTPScaledObject"]
    assert so["spec"]["hosts"] == ["models.example.com"]
    assert so["spec"]["replicas"] == {"min": 0, "max": 1}
    assert so["spec"]["scaledownPeriod"] == 60
    assert so["spec"]["timeouts"] == {"conditionWait": "90s", "responseHeader": "30s"}
    assert so["spec"]["scalingMetric"] == {"concurrency": {"targetValue": 8}}


def test_without_the_api_or_at_one_pod_the_operator_keeps_its_hpa():
    no_api = render_pool(OWNER, ZERO, CONFIG, False, wake_api=False)
    assert "HTTPScaledObject" not in kinds(no_api) and "HorizontalPodAutoscaler" in kinds(no_api)
    (hpa,) = [o for o in no_api.apply if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["minReplicas"] == 1  # an HPA cannot go to zero
    assert not any(kind == "HTTPScaledObject" for _, kind, _ in no_api.absent)  # no API: nothing to delete
    one = render_pool(OWNER, {"minReplicas": 1, "maxReplicas": 3}, CONFIG, False, wake_api=True)
    assert "HTTPScaledObject" not in kinds(one)
    assert (HTTP_SCALED_OBJECT_API, "HTTPScaledObject", "cpu-pool") in one.absent


def test_a_pool_at_zero_loads_models_on_demand():
    assert with_load_on_demand(ZERO, [])["args"] == [LOAD_ON_DEMAND_FLAG]
    assert "args" not in with_load_on_demand({"minReplicas": 1}, [])
    off = {**ZERO, "args": [f"{LOAD_ON_DEMAND_FLAG}=false"]}
    assert with_load_on_demand(off, [])["args"] == [f"{LOAD_ON_DEMAND_FLAG}=false"]  # the user's word stands


@on_session_loop
async def test_ensure_pool_applies_the_http_scaled_object_and_says_when_keda_is_missing(monkeypatch):
    posted = []
    monkeypatch.setattr(
        handlers, "post_event", lambda obj, kind, reason, message: posted.append((reason, message))
    )
    kube = FakeKube()
    pool = body("InferenceServer", "cpu", ZERO)
    assert await handlers.ensure_pool(memo(kube), pool, events=True) == []
    assert "HTTPScaledObject" not in [o["kind"] for o in kube.applied]
    assert "HorizontalPodAutoscaler" in [o["kind"] for o in kube.applied]  # until KEDA is there
    assert posted == [("ScaleToZeroUnavailable", MISSING_API)]
    deployment = next(o for o in kube.applied if o["kind"] == "Deployment")
    assert LOAD_ON_DEMAND_FLAG in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    kube.apis.add(HTTP_SCALED_OBJECT_API)
    posted.clear()
    await handlers.ensure_pool(memo(kube), pool, events=True)
    assert "HTTPScaledObject" in [o["kind"] for o in kube.applied] and posted == []
    assert ("HorizontalPodAutoscaler", "cpu") in kube.deleted  # KEDA's HPA takes over


@pytest.mark.parametrize("kind", ["InferenceServer", "InferenceModel"])
def test_crd_minimum_replicas(kind):
    spec = schema_of(kind)["properties"]["spec"]["properties"]
    if kind == "InferenceServer":
        assert spec["minReplicas"]["minimum"] == 0 and "scaleToZero" in spec
    else:  # a model's dedicated pool stays up; the model itself may go to zero copies on a shared pool
        server = spec["server"]["properties"]
        assert server["minReplicas"]["minimum"] == 1 and "scaleToZero" not in server
        assert spec["minReplicas"]["minimum"] == 0
