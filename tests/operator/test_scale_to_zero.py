"""minReplicas: 0: the --load-on-demand flag a pool gets for it, the intent's checks, the idle clock and the
decision table, and placement passes through idle -> no copies (Service on every on-demand pod) -> a copy loaded
on demand adopted as the model comes back."""

from __future__ import annotations

import json

import pytest
from operator_fakes import API, NS, FakeKube, FakeServers
from test_placement_pass import labels_of, model, server, status_of

from naiad_operator.config import OperatorConfig
from naiad_operator.draining import DrainBook
from naiad_operator.load_backoff import LoadBackoff
from naiad_operator.model_resources import model_intent
from naiad_operator.naming import PLACEMENTS_ANNOTATION
from naiad_operator.ownership import Owner
from naiad_operator.placement_pass import reconcile_pool
from naiad_operator.pool_resources import render_deployment
from naiad_operator.pool_snapshot import PoolContext
from naiad_operator.scale_to_zero import (
    IdleClock,
    decide,
    model_requests,
    runs_on_demand,
    scaled_in_status,
    with_load_on_demand,
)
from naiad_operator.variants import VariantMeter

on_session_loop = pytest.mark.asyncio(loop_scope="session")
LABEL = "naiad.dev/model-chat"
SPEC = {"serverRef": {"name": "gpu"}, "modelName": "chat", "replicas": 1, "minReplicas": 0, "idleSeconds": 60}


def test_flag_parsing_and_the_pool_gets_it_only_for_a_model_that_may_scale_to_zero():
    assert runs_on_demand(["serve", "--load-on-demand"])
    assert runs_on_demand(["--load-on-demand=true"])
    assert not runs_on_demand(["--load-on-demand", "--load-on-demand=false"])
    assert not runs_on_demand(["--load-on-demand-timeout=5"])
    pool_spec = {"replicas": 2, "args": ["--log-verbose=1"]}
    kept = {"spec": {"serverRef": {"name": "gpu"}, "replicas": 1}}
    zero = {"spec": dict(SPEC)}
    assert with_load_on_demand(pool_spec, [kept]) is pool_spec
    assert with_load_on_demand(pool_spec, [kept, zero])["args"] == ["--log-verbose=1", "--load-on-demand"]
    # a suspended model, or one without serverRef, gives the pool nothing to load on demand
    assert with_load_on_demand(pool_spec, [{"spec": {**SPEC, "suspended": True}}]) is pool_spec
    assert with_load_on_demand(pool_spec, [{"spec": {"minReplicas": 0}}]) is pool_spec
    # the user's own setting stands
    off = {"args": ["--load-on-demand=false"]}
    assert with_load_on_demand(off, [zero]) is off
    spec = with_load_on_demand({"replicas": 1}, [zero])
    container = render_deployment(
        Owner(API, "InferenceServer", "gpu", "uid-gpu", NS), spec, OperatorConfig()
    )["spec"]["template"]["spec"]["containers"][0]
    assert runs_on_demand(container["args"]) and "--model-control-mode=explicit" in container["args"]


def test_intent_scales_to_zero_on_a_shared_pool_only():
    intent = model_intent("chat", SPEC)
    assert intent.scales_to_zero and intent.idle_seconds == 60 and not intent.problems
    assert model_intent("chat", {**SPEC, "idleSeconds": None}).idle_seconds == 300
    assert not model_intent("chat", {**SPEC, "minReplicas": 1}).scales_to_zero
    dedicated = model_intent("chat", {"modelName": "chat", "minReplicas": 0, "storage": {"uri": "pvc://m"}})
    assert not dedicated.scales_to_zero
    assert any("needs serverRef" in p for p in dedicated.problems)
    canary = model_intent("chat", {**SPEC, "version": 1, "canary": {"version": 2, "trafficPercent": 50}})
    assert any("canary" in p for p in canary.problems)


def test_idle_clock_restarts_on_every_change_and_never_counts_an_unread_model():
    now = [0.0]
    clock = IdleClock(clock=lambda: now[0])
    assert clock.idle_for(NS, "chat", 5.0) == 0.0
    now[0] = 30.0
    assert clock.idle_for(NS, "chat", 5.0) == 30.0
    assert clock.idle_for(NS, "chat", None) is None  # a pod could not be read: not idle
    now[0] = 40.0
    assert clock.idle_for(NS, "chat", 7.0) == 0.0  # a request came
    now[0] = 100.0
    assert clock.idle_for(NS, "chat", 7.0) == 60.0
    clock.set_scaled(NS, "chat", True)
    assert clock.scaled(NS, "chat", None)
    # unknown to this clock (an operator that restarted): the status says
    status = {"conditions": [{"type": "ScaledToZero", "status": "True"}]}
    assert scaled_in_status(status) and clock.scaled(NS, "other", status)
    assert not clock.scaled(NS, "other", {"conditions": [{"type": "ScaledToZero", "status": "False"}]})
    counters = {"10.0.0.1": {"chat": (3.0, 1.0)}, "10.0.0.2": {}}
    assert model_requests(counters, ["10.0.0.1", "10.0.0.2"], "chat") == 4.0
    assert model_requests(counters, ["10.0.0.1", "10.0.0.3"], "chat") is None


@pytest.mark.parametrize(
    ("before", "holders", "on_demand", "others", "idle_for", "scaled", "woke", "went"),
    [
        (False, 1, 3, 0, 59.0, False, False, False),  # not idle long enough
        (False, 1, 3, 0, 60.0, True, False, True),  # idle: give up the copies
        (False, 1, 3, 0, None, False, False, False),  # counters unread: keep
        (False, 1, 2, 1, 600.0, False, False, False),  # one pod could not load it on demand: keep
        (False, 1, 0, 3, 600.0, False, False, False),  # no pod runs --load-on-demand yet
        (True, 0, 3, 0, None, True, False, False),  # stays at zero
        (True, 1, 3, 0, None, False, True, False),  # a request loaded it on demand: back
        (True, 0, 0, 0, None, False, True, False),  # nothing could load it on demand any more: back
        (True, 0, 2, 1, None, False, True, False),
    ],
)
def test_decision_table(before, holders, on_demand, others, idle_for, scaled, woke, went):
    decision = decide(
        scaled_before=before,
        holders=holders,
        on_demand_pods=on_demand,
        other_pods=others,
        idle_seconds=60,
        idle_for=idle_for,
    )
    assert (decision.scaled, decision.woke, decision.went) == (scaled, woke, went)


class FakeMeter(VariantMeter):
    """Request counters per pod IP, as the servers' /metrics would report them."""

    def __init__(self):
        super().__init__(session=None, timeout=1)  # type: ignore[arg-type]
        self.counters: dict[str, dict[str, tuple[float, float]]] = {}
        self.scraped: list[list[str]] = []

    async def scrape_all(self, ips):
        ips = sorted(set(ips))
        self.scraped.append(ips)
        return {ip: dict(self.counters.get(ip, {})) for ip in ips}


def on_demand_pod(name, ip, on_demand=True):
    args = ["serve", "--model-control-mode=explicit"] + (["--load-on-demand"] if on_demand else [])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"naiad.dev/server": "gpu", "pod-template-hash": "h1"}},
        "spec": {"containers": [{"name": "server", "args": args}]},
        "status": {"podIP": ip, "containerStatuses": [{"name": "server", "ready": True, "restartCount": 0}]},
    }


def make_world(on_demand=True):
    kube, servers, meter = FakeKube(), FakeServers(), FakeMeter()
    kube.add(server(spec={"replicas": 3}))
    for i in range(3):
        kube.add(on_demand_pod(f"gpu-{i}", f"10.0.0.{i}", on_demand))
    now = [1000.0]
    ctx = PoolContext(
        kube=kube,
        control=servers,
        config=OperatorConfig(),
        backoff=LoadBackoff(30.0, clock=lambda: now[0]),
        meter=meter,
        idle=IdleClock(clock=lambda: now[0]),
    )
    return kube, servers, meter, ctx, now


def conditions_of(kube, name):
    return {c["type"]: c for c in status_of(kube, "InferenceModel", name)["conditions"]}


def labelled(kube):
    return [p for p in ("gpu-0", "gpu-1", "gpu-2") if labels_of(kube, p).get(LABEL) == "loaded"]


async def placed(ctx) -> None:
    """The pass that places a model, and the next one, which finds its copy ready: its idle clock starts there."""
    await reconcile_pool(ctx, NS, "gpu")
    await reconcile_pool(ctx, NS, "gpu")


@on_session_loop
async def test_the_time_a_copy_takes_to_load_is_not_idle_time():
    """A model is idle when the pods holding it see no request; until a copy is ready nothing can call it (a large
    model may load for longer than idleSeconds): its clock starts at the first pass that finds a ready copy."""
    kube, servers, _, ctx, now = make_world()
    kube.add(model("chat", dict(SPEC)))
    await reconcile_pool(ctx, NS, "gpu")  # places it (the pass's snapshot was taken before the load)
    now[0] += 61  # the next pass, as long after as the load might take
    await reconcile_pool(ctx, NS, "gpu")
    assert status_of(kube, "InferenceModel", "chat")["phase"] == "Available"
    assert sum("chat" in models for models in servers.loaded.values()) == 1
    now[0] += 61  # idle since its copy was found ready
    await reconcile_pool(ctx, NS, "gpu")
    assert status_of(kube, "InferenceModel", "chat")["phase"] == "ScaledToZero"


@on_session_loop
async def test_idle_model_gives_up_its_copies_then_a_load_on_demand_brings_it_back():
    kube, servers, meter, ctx, now = make_world()
    kube.add(model("chat", dict(SPEC)))
    await reconcile_pool(ctx, NS, "gpu")
    (holder,) = [ip for ip, models in servers.loaded.items() if "chat" in models]
    status = status_of(kube, "InferenceModel", "chat")
    assert status["phase"] == "Available" and status["replicas"] == 1
    assert conditions_of(kube, "chat")["ScaledToZero"]["status"] == "False"
    assert len(labelled(kube)) == 1

    # requests keep it: the counters of its holder move
    meter.counters[holder] = {"chat": (5.0, 0.0)}
    now[0] += 50
    await reconcile_pool(ctx, NS, "gpu")
    meter.counters[holder] = {"chat": (9.0, 1.0)}
    now[0] += 50
    await reconcile_pool(ctx, NS, "gpu")
    assert "chat" in servers.loaded[holder]
    assert [holder] in meter.scraped and all(set(ips) <= {holder} for ips in meter.scraped)  # only its holder

    # idle for idleSeconds: unloaded everywhere; the Service now selects every on-demand pod
    now[0] += 61
    await reconcile_pool(ctx, NS, "gpu")
    assert all("chat" not in models for models in servers.loaded.values())
    assert labelled(kube) == ["gpu-0", "gpu-1", "gpu-2"]
    status = status_of(kube, "InferenceModel", "chat")
    assert status["phase"] == "ScaledToZero"
    assert (status["replicas"], status["desiredReplicas"], status["availableReplicas"]) == (0, 0, 0)
    cond = conditions_of(kube, "chat")
    assert cond["ScaledToZero"]["status"] == "True" and cond["Ready"]["status"] == "True"
    assert "3 pods of gpu load it" in cond["ServiceReady"]["message"]
    for pod in ("gpu-0", "gpu-1", "gpu-2"):  # routes are labels, not placements
        annotation = kube.obj("v1", "Pod", pod)["metadata"]["annotations"][PLACEMENTS_ANNOTATION]
        assert "chat" not in json.loads(annotation)

    # at zero, a pass does nothing: no loads, no counters read, no writes
    calls, writes = len(servers.calls), len(kube.status_writes)
    now[0] += 600
    await reconcile_pool(ctx, NS, "gpu")
    assert len(servers.calls) == calls and len(kube.status_writes) == writes

    # a request reached gpu-2 and its server loaded the model on demand: adopted as it is, not reloaded
    servers.loaded.setdefault("10.0.0.2", {})["chat"] = "1"
    await reconcile_pool(ctx, NS, "gpu")
    assert len(servers.calls) == calls
    assert labelled(kube) == ["gpu-2"]
    status = status_of(kube, "InferenceModel", "chat")
    assert status["phase"] == "Available" and status["replicas"] == 1 and status["desiredReplicas"] == 1
    assert conditions_of(kube, "chat")["ScaledToZero"]["status"] == "False"
    annotation = kube.obj("v1", "Pod", "gpu-2")["metadata"]["annotations"][PLACEMENTS_ANNOTATION]
    assert json.loads(annotation)["chat"]["model"] == "chat"

    # its idle clock started again when it came back
    now[0] += 59
    await reconcile_pool(ctx, NS, "gpu")
    assert servers.loaded["10.0.0.2"].get("chat") == "1"


@on_session_loop
async def test_a_burst_on_several_pods_keeps_the_replicas_asked_for():
    kube, servers, _, ctx, now = make_world()
    kube.add(model("chat", dict(SPEC)))
    await placed(ctx)
    now[0] += 61
    await reconcile_pool(ctx, NS, "gpu")
    assert status_of(kube, "InferenceModel", "chat")["phase"] == "ScaledToZero"
    for ip in ("10.0.0.0", "10.0.0.1"):
        servers.loaded.setdefault(ip, {})["chat"] = "1"
    await reconcile_pool(ctx, NS, "gpu")
    assert sum("chat" in models for models in servers.loaded.values()) == 1
    assert len(labelled(kube)) == 1


@on_session_loop
async def test_pods_without_load_on_demand_keep_the_copies():
    kube, servers, _, ctx, now = make_world(on_demand=False)
    kube.add(model("chat", dict(SPEC)))
    await reconcile_pool(ctx, NS, "gpu")
    now[0] += 3600
    await reconcile_pool(ctx, NS, "gpu")
    assert sum("chat" in models for models in servers.loaded.values()) == 1
    status = status_of(kube, "InferenceModel", "chat")
    assert status["phase"] == "Available"


@on_session_loop
async def test_an_operator_that_restarts_keeps_a_scaled_model_at_zero():
    kube, servers, _, ctx, now = make_world()
    kube.add(model("chat", dict(SPEC)))
    await placed(ctx)
    now[0] += 61
    await reconcile_pool(ctx, NS, "gpu")
    ctx.idle = IdleClock(clock=lambda: now[0])  # what a new operator process starts with
    await reconcile_pool(ctx, NS, "gpu")
    assert all("chat" not in models for models in servers.loaded.values())
    assert status_of(kube, "InferenceModel", "chat")["phase"] == "ScaledToZero"
    assert labelled(kube) == ["gpu-0", "gpu-1", "gpu-2"]
    # and a model that stops scaling to zero gets its copies back, and its labels off the other pods
    kube.obj(API, "InferenceModel", "chat")["spec"]["minReplicas"] = 1
    await reconcile_pool(ctx, NS, "gpu")
    assert sum("chat" in models for models in servers.loaded.values()) == 1
    assert len(labelled(kube)) == 1
    assert "ScaledToZero" not in conditions_of(kube, "chat")


@on_session_loop
async def test_going_to_zero_unloads_at_once_where_the_pods_stay_routed():
    """Route first, unload after (draining.py) has nothing to wait for here: the on-demand pods keep the model's
    label (they load it on the next request), so the copies go in the pass that scales to zero."""
    kube, servers, _, ctx, now = make_world()
    ctx.drain = DrainBook(5.0, clock=lambda: now[0])
    kube.add(model("chat", dict(SPEC)))
    await placed(ctx)
    now[0] += 61
    report = await reconcile_pool(ctx, NS, "gpu")
    assert all("chat" not in models for models in servers.loaded.values())
    assert labelled(kube) == ["gpu-0", "gpu-1", "gpu-2"]
    assert report.draining == {} and report.recheck_in is None
