"""Status builders: phases, conditions, counts; lastTransitionTime only moves when a status changes."""

from __future__ import annotations

from naiad_operator.status import (
    ModelCount,
    ModelObservation,
    Placement,
    condition,
    merge_conditions,
    merged_status,
    model_phase,
    model_status,
    server_status,
    status_changes,
)

NOW, LATER = "2024-01-01T00:00:00Z", "2024-01-01T01:00:00Z"


def observed(**kwargs):
    base = {"wanted": 2, "holding": 0, "available": 0, "eligible_pods": 2}
    return ModelObservation(**{**base, **kwargs})


def phase(**kwargs):
    defaults = {"problems": [], "suspended": False, "pool_found": True}
    obs = kwargs.pop("observed")
    return model_phase(observed=obs, **{**defaults, **kwargs})


def test_phases():
    assert phase(observed=observed(available=2, holding=2)) == "Available"
    assert phase(observed=observed(available=1, holding=1)) == "PartiallyAvailable"
    assert phase(observed=observed(loading=True)) == "Loading"
    assert phase(observed=observed(failure={"pod": "p", "message": "bad", "time": NOW})) == "Failed"
    assert phase(observed=observed()) == "Pending"
    assert phase(observed=observed(retrying={"p": "bad"})) == "Failed"  # waiting out a back-off, still failed
    assert phase(observed=observed(), pool_found=False) == "Pending"
    assert phase(observed=observed(available=2), suspended=True) == "Suspended"
    assert phase(observed=observed(available=2), problems=["bad"]) == "Failed"


def test_merge_conditions_keeps_transition_time_for_unchanged_status():
    first = merge_conditions(None, [condition("Ready", True, "Ready")], NOW, 1)
    assert first[0]["lastTransitionTime"] == NOW and first[0]["observedGeneration"] == 1
    same = merge_conditions(first, [condition("Ready", True, "Ready", "other message")], LATER, 2)
    assert same[0]["lastTransitionTime"] == NOW
    flipped = merge_conditions(same, [condition("Ready", False, "Down")], LATER)
    assert flipped[0]["lastTransitionTime"] == LATER and flipped[0]["status"] == "False"


def model(obs, **kwargs):
    args = {
        "generation": 3,
        "pool": "gpu",
        "model_name": "resnet50",
        "revision": "abc",
        "selector": "s=1",
        "endpoint": {"service": "resnet", "http": "h", "grpc": "g"},
        "problems": [],
        "suspended": False,
        "pool_found": True,
        "observed": obs,
        "old_status": None,
        "now": NOW,
    }
    args.update(kwargs)
    return model_status(**args)


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_available_model_status():
    obs = observed(
        available=2,
        holding=2,
        placements=[Placement("p2", "Loaded", "10.0.0.2", "1"), Placement("p1", "Loaded", "10.0.0.1", "1")],
    )
    status = model(obs)
    assert status["phase"] == "Available"
    assert status["desiredReplicas"] == 2 and status["replicas"] == 2 and status["availableReplicas"] == 2
    assert [p["pod"] for p in status["placements"]] == ["p1", "p2"]
    assert status["placements"][0] == {"pod": "p1", "state": "Loaded", "ip": "10.0.0.1", "version": "1"}
    assert (
        status["server"] == "gpu" and status["modelName"] == "resnet50" and status["observedGeneration"] == 3
    )
    assert conditions(status) == {
        "Scheduled": ("True", "Placed"),
        "Loaded": ("True", "Loaded"),
        "ServiceReady": ("True", "Endpoints"),
        "Ready": ("True", "Ready"),
    }
    assert "lastFailure" not in status


def test_capacity_shortfall_and_failures_are_explained():
    failure = {"time": NOW, "pod": "p1", "message": "out of memory"}
    status = model(observed(available=1, holding=1, shortfall=1, failure=failure))
    assert status["phase"] == "PartiallyAvailable"
    cond = conditions(status)
    assert cond["Scheduled"] == ("False", "InsufficientCapacity")
    assert cond["Loaded"] == ("False", "LoadFailed")
    assert cond["Ready"] == ("False", "InsufficientCapacity")
    assert status["lastFailure"] == failure
    # the last failure stays visible after later passes that had none
    again = model(observed(available=2, holding=2), old_status=status)
    assert again["lastFailure"] == failure and again["phase"] == "Available"


def test_missing_pool_invalid_spec_and_suspension():
    assert conditions(model(observed(), pool_found=False))["Scheduled"] == ("False", "ServerNotFound")
    invalid = model(observed(), problems=["bad name"])
    assert invalid["phase"] == "Failed" and all(
        v == ("False", "InvalidSpec") for v in conditions(invalid).values()
    )
    suspended = model(observed(wanted=0), suspended=True)
    assert suspended["phase"] == "Suspended" and conditions(suspended)["Ready"] == ("False", "Suspended")
    no_pods = model(observed(eligible_pods=0))
    assert conditions(no_pods)["Scheduled"] == ("False", "NoReadyPods")


def test_server_status():
    deployment = {"status": {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3}}
    hpa = {
        "status": {
            "conditions": [
                {"type": "AbleToScale", "status": "True"},
                {"type": "ScalingActive", "status": "True"},
            ]
        }
    }
    status = server_status(
        generation=2,
        selector="naiad.dev/server=gpu",
        desired=3,
        deployment=deployment,
        hpa=hpa,
        hpa_wanted=True,
        models=[ModelCount("resnet", "resnet50", 2)],
        problems=[],
        old_conditions=None,
        now=NOW,
    )
    assert status["replicas"] == 3 and status["readyReplicas"] == 3 and status["modelCount"] == 1
    assert status["models"] == [{"name": "resnet", "modelName": "resnet50", "pods": 2}]
    assert status["selector"] == "naiad.dev/server=gpu"
    assert conditions(status) == {
        "WorkloadReady": ("True", "PodsReady"),
        "AutoscalerReady": ("True", "ScalingActive"),
        "Ready": ("True", "Ready"),
    }


def test_server_status_when_things_are_missing_or_failing():
    hpa = {
        "status": {
            "conditions": [
                {
                    "type": "ScalingActive",
                    "status": "False",
                    "reason": "FailedGetPodsMetric",
                    "message": "no metrics",
                }
            ]
        }
    }
    status = server_status(
        generation=1,
        selector="s",
        desired=2,
        deployment={"status": {"readyReplicas": 1}},
        hpa=hpa,
        hpa_wanted=True,
        models=[],
        problems=[],
        old_conditions=None,
        now=NOW,
    )
    cond = conditions(status)
    assert cond["WorkloadReady"] == ("False", "PodsNotReady")
    assert cond["AutoscalerReady"] == ("False", "MetricsUnavailable")
    assert cond["Ready"] == ("False", "PodsNotReady")
    nothing = server_status(
        generation=1,
        selector="s",
        desired=1,
        deployment=None,
        hpa=None,
        hpa_wanted=False,
        models=[],
        problems=["args: --http-port is set by the operator"],
        old_conditions=None,
        now=NOW,
    )
    assert conditions(nothing) == {
        "WorkloadReady": ("False", "NotCreated"),
        "AutoscalerReady": ("True", "Disabled"),
        "Ready": ("False", "InvalidSpec"),
    }
    zero = server_status(
        generation=1,
        selector="s",
        desired=0,
        deployment={"status": {}},
        hpa=None,
        hpa_wanted=False,
        models=[],
        problems=[],
        old_conditions=None,
        now=NOW,
    )
    assert conditions(zero)["Ready"] == ("True", "Ready")


def test_status_changes_agrees_with_the_merge_it_stands_for():
    old = {
        "phase": "Available",
        "replicas": 1,
        "endpoint": {"service": "m", "http": "h"},
        "conditions": [{"type": "Ready", "status": "True"}],
        "variants": [{"name": "stable"}],
    }
    patches = [
        {},
        {"phase": "Available"},
        {"phase": "Loading"},
        {"endpoint": {"service": "m"}},
        {"endpoint": {"service": "m2"}},
        {"endpoint": {"grpc": None}},
        {"endpoint": {"http": None}},
        {"variants": None},
        {"lastFailure": None},
        {"lastFailure": {"pod": "p"}},
        {"conditions": [{"type": "Ready", "status": "True"}]},
        {"conditions": [{"type": "Ready", "status": "False"}]},
        {"replicas": {"a": 1}},
        {"phase": "Available", "replicas": 2},
    ]
    for patch in patches:
        assert status_changes(old, patch) == (merged_status(old, patch) != old), patch
    assert status_changes(None, {})


def test_server_status_of_a_pool_keda_scales_to_zero_pods():
    status = server_status(
        generation=1,
        selector="s",
        desired=0,
        deployment={"status": {}},
        hpa=None,  # KEDA's HPA has its own name; the operator's is gone
        hpa_wanted=True,
        models=[],
        problems=[],
        old_conditions=None,
        now=NOW,
        autoscaler_delegated_to="KEDA scales this pool",
    )
    assert conditions(status) == {
        "WorkloadReady": ("True", "ScaledToZero"),
        "AutoscalerReady": ("True", "Delegated"),
        "Ready": ("True", "Ready"),
    }
