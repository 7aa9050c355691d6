"""Canaries: the canary's intent and promotion patch, how many copies hold it, which pods, one placement pass
with the in-memory clients (loads with each variant's config, status.variants, roll forward and back), and the
parsing of the servers' request counters that status.variants reports."""

from __future__ import annotations

import pytest
from test_placement_pass import model, status_of, world  # noqa: F401 - the fixture is used by name

from naiad_operator.model_resources import model_intent, promotion_patch
from naiad_operator.placement import Capacity, Demand, PodState, canary_count, plan_pool
from naiad_operator.placement_pass import reconcile_pool
from naiad_operator.variants import VariantMeter, parse_counters

on_session_loop = pytest.mark.asyncio(loop_scope="session")


def test_canary_intent_has_its_own_revision_and_config():
    spec = {"serverRef": {"name": "gpu"}, "config": {"max_batch_size": 8}, "version": 1}
    stable = model_intent("m", spec)
    assert stable.canary is None and stable.revisions == (stable.revision,)
    intent = model_intent("m", {**spec, "canary": {"version": 2, "trafficPercent": 25}})
    assert intent.revision == stable.revision  # the stable variant does not move
    assert intent.canary is not None and intent.canary.percent == 25
    assert intent.canary.load_config == {
        "max_batch_size": 8,
        "version_policy": {"specific": {"versions": [2]}},
    }
    assert intent.variant(intent.canary.revision) == ("canary", intent.canary.load_config, "2")
    assert intent.variant(intent.revision)[0] == "stable"
    # a canary identical to the model is no canary; a canary without a change or a share is a problem
    assert model_intent("m", {**spec, "canary": {"version": 1, "trafficPercent": 50}}).canary is None
    assert model_intent("m", {**spec, "canary": {"trafficPercent": 50}}).problems
    assert model_intent("m", {**spec, "canary": {"version": 2, "trafficPercent": 101}}).problems


def test_promotion_replaces_version_and_config_and_removes_the_canary():
    spec = {"config": {"a": 1, "b": 2}, "canary": {"config": {"a": 3}, "trafficPercent": 10, "promote": True}}
    assert promotion_patch(spec) == [
        {"op": "remove", "path": "/spec/canary"},
        {"op": "add", "path": "/spec/config", "value": {"a": 3}},
    ]


@pytest.mark.parametrize(
    ("copies", "percent", "canaries"),
    [
        (4, 25, 1),
        (4, 50, 2),
        (4, 10, 1),
        (4, 90, 3),
        (4, 100, 4),
        (4, 0, 0),
        (1, 50, 0),
        (1, 100, 1),
        (3, 34, 1),
    ],
)
def test_canary_count_keeps_one_copy_of_each_variant(copies, percent, canaries):
    assert canary_count(copies, percent) == canaries


def test_canary_goes_first_where_it_already_is_then_where_neither_is():
    pods = [
        PodState("a", "10.0.0.1", True, held={"m": "stable"}),
        PodState("b", "10.0.0.2", True, held={"m": "old"}),
        PodState("c", "10.0.0.3", True, held={"m": "canary"}),
        PodState("d", "10.0.0.4", True, held={"m": "stable"}),
    ]
    demand = Demand("m", "stable", 4, canary_revision="canary", canary_percent=50)
    plan = plan_pool([demand], pods, Capacity())["m"]
    assert plan.revisions == {"a": "stable", "b": "canary", "c": "canary", "d": "stable"}
    assert sorted(plan.keep) == ["a", "c", "d"] and plan.load == ["b"]
    # rolled back: the canary copy is reloaded with the stable revision, in place
    plan = plan_pool([Demand("m", "stable", 4)], pods, Capacity())["m"]
    assert sorted(plan.load) == ["b", "c"] and set(plan.revisions.values()) == {"stable"}


@on_session_loop
async def test_a_pass_places_the_canary_and_reports_both_variants(world):  # noqa: F811
    kube, servers, ctx, _ = world
    base = {"serverRef": {"name": "gpu"}, "modelName": "resnet50", "replicas": 3, "version": 1}
    kube.add(model("resnet", {**base, "canary": {"version": 2, "trafficPercent": 34}}))
    await reconcile_pool(ctx, "ml", "gpu")
    versions = sorted(servers.loaded[ip]["resnet50"] for ip in servers.loaded)
    assert versions == ["1", "1", "2"]
    status = status_of(kube, "InferenceModel", "resnet")
    assert status["phase"] == "Available" and status["availableReplicas"] == 3
    variants = {v["name"]: v for v in status["variants"]}
    assert variants["stable"]["replicas"] == 2 and variants["stable"]["version"] == "1"
    assert variants["canary"]["replicas"] == 1 and variants["canary"]["version"] == "2"
    assert variants["canary"]["trafficPercent"] == 33
    assert {p["variant"] for p in status["placements"]} == {"stable", "canary"}
    # a steady state: the next pass keeps both variants where they are (no reload resets their counters)
    loads = len([c for c in servers.calls if c[0] == "load"])
    await reconcile_pool(ctx, "ml", "gpu")
    assert len([c for c in servers.calls if c[0] == "load"]) == loads
    # roll back: the canary pod reloads the stable version; status.variants goes away
    kube.obj("naiad.dev/v1alpha1", "InferenceModel", "resnet")["spec"].pop("canary")
    await reconcile_pool(ctx, "ml", "gpu")
    assert sorted(servers.loaded[ip]["resnet50"] for ip in servers.loaded) == ["1", "1", "1"]
    status = status_of(kube, "InferenceModel", "resnet")
    assert "variants" not in status and status["availableReplicas"] == 3


METRICS = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="add_sub",version="1"} 12
nv_inference_request_success{model="other",version="3"} 1
nv_inference_request_failure{model="add_sub",reason="BACKEND",version="1"} 2
nv_inference_request_failure{model="add_sub",reason="REJECTED",version="1"} 1
nv_inference_count{model="add_sub",version="1"} 40
"""


def test_request_counters_and_rates_per_variant():
    assert parse_counters(METRICS) == {"add_sub": (12.0, 3.0), "other": (1.0, 0.0)}
    now = [100.0]
    meter = VariantMeter(session=None, timeout=1, clock=lambda: now[0])  # type: ignore[arg-type]
    first = meter.traffic("ml", "m", "r1", [(12.0, 3.0), (5.0, 0.0)])
    assert (first.requests, first.failures, first.request_rate) == (20, 3, None)
    now[0] = 110.0
    second = meter.traffic("ml", "m", "r1", [(22.0, 3.0), (15.0, 1.0)])
    assert second.requests == 41 and second.request_rate == pytest.approx(2.1)
    assert second.failure_rate == pytest.approx(0.1)
