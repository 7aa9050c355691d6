"""Placement decisions: where models stay, load and unload, under capacity, rollouts and back-off."""

from __future__ import annotations

from naiad_operator.placement import Capacity, Demand, Plan, PodState, plan_pool, unloads_allowed


def pod(name, held=None, ready=True, leaving=False, loaded=None, ip="10.0.0.1", node=None):
    held = held or {}
    return PodState(
        name=name,
        ip=ip,
        ready=ready,
        leaving=leaving,
        held=held,
        loaded_count=len(held) if loaded is None else loaded,
        node=node,
    )


UNLIMITED = Capacity()


def plan(demands, pods, capacity=UNLIMITED):
    return plan_pool(demands, pods, capacity)


def test_new_model_goes_to_the_emptiest_ready_pods():
    pods = [pod("a", {"x": "r"}), pod("b"), pod("c", {"x": "r", "y": "r"}), pod("d", ready=False)]
    result = plan([Demand("m", "r1", 2)], pods)["m"]
    assert result.load == ["b", "a"]
    assert result.keep == [] and result.unload == [] and result.shortfall == 0


def test_pods_already_holding_the_model_are_preferred():
    pods = [pod("a"), pod("b", {"m": "r1"}), pod("c", {"m": "r1"})]
    result = plan([Demand("m", "r1", 2)], pods)["m"]
    assert result.keep == ["b", "c"] and result.load == [] and result.unload == []


def test_stale_revision_is_reloaded_in_place_not_moved():
    pods = [pod("a"), pod("b", {"m": "old"})]
    result = plan([Demand("m", "new", 1)], pods)["m"]
    assert result.load == ["b"] and result.keep == [] and result.unload == []


def test_scale_down_unloads_surplus_copies():
    pods = [pod("a", {"m": "r"}), pod("b", {"m": "r"}), pod("c", {"m": "r"})]
    result = plan([Demand("m", "r", 1)], pods)["m"]
    assert result.keep == ["a"] and result.unload == ["b", "c"]


def test_zero_replicas_unloads_everywhere():
    pods = [pod("a", {"m": "r"}), pod("b", {"m": "old"}), pod("c")]
    result = plan([Demand("m", "r", 0)], pods)["m"]
    assert result.unload == ["a", "b"] and result.chosen == [] and result.shortfall == 0


def test_not_ready_pods_and_pods_without_ip_are_skipped():
    pods = [pod("a", ready=False), pod("b", ip=None), pod("c")]
    result = plan([Demand("m", "r", 3)], pods)["m"]
    assert result.load == ["c"] and result.shortfall == 2


def test_max_models_capacity_is_shared_across_models_in_order():
    pods = [pod("a"), pod("b")]
    result = plan([Demand("first", "r", 2), Demand("second", "r", 2)], pods, Capacity(max_models=1))
    assert result["first"].load == ["a", "b"]
    assert result["second"].load == [] and result["second"].shortfall == 2


def test_models_loaded_by_others_take_slots():
    pods = [pod("a", loaded=2), pod("b", loaded=0)]
    result = plan([Demand("m", "r", 2)], pods, Capacity(max_models=2))["m"]
    assert result.load == ["b"] and result.shortfall == 1


def test_memory_capacity():
    pods = [pod("a", {"big": "r"}), pod("b")]
    demands = [Demand("big", "r", 1, memory=6), Demand("m", "r", 2, memory=5)]
    result = plan(demands, pods, Capacity(memory=10))
    assert result["big"].keep == ["a"]
    assert result["m"].load == ["b"] and result["m"].shortfall == 1


def test_holders_never_need_a_new_slot():
    pods = [pod("a", {"m": "old"}, loaded=4)]
    result = plan([Demand("m", "new", 1)], pods, Capacity(max_models=4))["m"]
    assert result.load == ["a"] and result.shortfall == 0


def test_every_pod_mode_for_dedicated_pools():
    pods = [pod("a", {"m": "r"}), pod("b"), pod("c", ready=False)]
    result = plan([Demand("m", "r", None)], pods)["m"]
    assert result.keep == ["a"] and result.load == ["b"] and result.shortfall == 0


def test_rollout_prefers_new_pods_and_keeps_serving_on_leaving_ones():
    pods = [pod("old1", {"m": "r"}, leaving=True), pod("old2", {"m": "r"}, leaving=True), pod("new1")]
    result = plan([Demand("m", "r", 2)], pods)["m"]
    # new1 gets a copy, old1 keeps serving; old2 is surplus but keeps serving until its pod goes (unloading it
    # would fail the requests still routed there)
    assert result.load == ["new1"] and result.keep == ["old1"] and result.unload == []
    gone = plan([Demand("m", "r", 0)], pods)["m"]
    assert sorted(gone.unload) == ["old1", "old2"]  # a model going away leaves leaving pods too
    every = plan([Demand("m", "r", None)], pods)["m"]
    assert every.load == ["new1"] and sorted(every.keep) == ["old1", "old2"] and every.unload == []


def test_leaving_pods_are_a_last_resort_for_new_copies():
    pods = [pod("old", leaving=True), pod("new", loaded=1)]
    result = plan([Demand("m", "r", 2)], pods, Capacity(max_models=1))["m"]
    assert result.load == ["old"] and result.shortfall == 1


def test_back_off_avoids_failed_pods_and_keeps_stale_copies():
    pods = [pod("a"), pod("b"), pod("c", {"m": "old"})]
    result = plan([Demand("m", "new", 2, avoid=frozenset({"a", "c"}))], pods)["m"]
    assert result.load == ["b"] and result.keep == ["c"]  # c keeps serving the old revision meanwhile
    every = plan([Demand("m", "r", None, avoid=frozenset({"a"}))], [pod("a"), pod("b")])["m"]
    assert every.load == ["b"] and every.shortfall == 1


def test_deterministic_order():
    pods = [pod(n) for n in "dcba"]
    assert plan([Demand("m", "r", 2)], pods)["m"].load == ["a", "b"]


def test_unloads_wait_for_the_loads_they_replace():
    demand = Demand("m", "r", 1)
    moving = Plan(keep=[], load=["b"], unload=["a"])
    assert unloads_allowed(moving, demand, loaded=[]) == []
    assert unloads_allowed(moving, demand, loaded=["b"]) == ["a"]
    assert unloads_allowed(Plan(unload=["a"]), Demand("m", "r", 0), loaded=[]) == ["a"]


def test_wanted_counts_placed_and_missing_copies():
    result = plan([Demand("m", "r", 3)], [pod("a", {"m": "r"}), pod("b")])["m"]
    assert result.wanted == 3 and result.chosen == ["a", "b"] and result.shortfall == 1


def test_copies_that_share_a_node_move_when_another_node_has_a_ready_pod():
    # The pods came up one by one: both copies landed on n1 before n2's pod was ready.
    pods = [pod("a", {"m": "r1"}, node="n1"), pod("b", {"m": "r1"}, node="n1"), pod("c", node="n2")]
    result = plan([Demand("m", "r1", 2)], pods)["m"]
    assert result.keep == ["a"] and result.load == ["c"] and result.unload == ["b"]
    # the copy on b goes only once c holds the model
    assert unloads_allowed(result, Demand("m", "r1", 2), []) == []
    assert unloads_allowed(result, Demand("m", "r1", 2), ["c"]) == ["b"]
    # afterwards, nothing moves
    pods = [pod("a", {"m": "r1"}, node="n1"), pod("b", node="n1"), pod("c", {"m": "r1"}, node="n2")]
    result = plan([Demand("m", "r1", 2)], pods)["m"]
    assert result.keep == ["a", "c"] and result.load == [] and result.unload == []


def test_copies_stay_together_when_no_other_node_can_take_one():
    full = Capacity(max_models=1)
    pods = [
        pod("a", {"m": "r1"}, node="n1"),
        pod("b", {"m": "r1"}, node="n1"),
        pod("c", {"x": "r"}, node="n2"),
    ]
    result = plan([Demand("m", "r1", 2)], pods, full)["m"]
    assert result.keep == ["a", "b"] and result.load == [] and result.unload == []
    # nor when the pod there is not ready, or waits out a failed load
    pods[2] = pod("c", node="n2", ready=False)
    assert plan([Demand("m", "r1", 2)], pods)["m"].keep == ["a", "b"]
    pods[2] = pod("c", node="n2")
    avoided = plan([Demand("m", "r1", 2, avoid=frozenset({"c"}))], pods)["m"]
    assert avoided.keep == ["a", "b"] and avoided.load == []


def test_copies_of_a_model_go_to_different_nodes_first():
    pods = [pod("a", node="n1"), pod("b", node="n1"), pod("c", node="n2", loaded=1), pod("d", node="n2")]
    assert sorted(plan([Demand("m", "r1", 2)], pods)["m"].load) == ["a", "d"]
    # a copy already on n1 makes the new one go to n2, even to a fuller pod
    pods = [pod("a", {"m": "r1"}, node="n1"), pod("b", node="n1"), pod("c", {"x": "r"}, node="n2")]
    result = plan([Demand("m", "r1", 2)], pods)["m"]
    assert result.keep == ["a"] and result.load == ["c"]
    # more copies than nodes: spread evenly, then fill
    pods = [pod(f"p{i}", node=f"n{i % 2}") for i in range(4)]
    chosen = plan([Demand("m", "r1", 3)], pods)["m"].load
    assert sorted(p.node for p in pods if p.name in chosen) == ["n0", "n0", "n1"]


def test_copies_waiting_to_be_unloaded_are_kept_last_but_before_a_new_load():
    pods = [pod("a", {"m": "r1"}), pod("b", {"m": "r1"}), pod("c")]
    # a's copy is no longer routed (draining.py): b's copy is kept instead, and a's goes on waiting
    p = plan([Demand("m", "r1", replicas=1, draining=frozenset({"a"}))], pods)["m"]
    assert (p.keep, p.load, p.unload) == (["b"], [], ["a"])
    # wanting two copies again takes a's copy back rather than loading one on c
    p = plan([Demand("m", "r1", replicas=2, draining=frozenset({"a"}))], pods)["m"]
    assert (sorted(p.keep), p.load, p.unload) == (["a", "b"], [], [])


def _counts(pods):
    return {p.name: len(p.held) for p in pods}


def test_a_pod_that_replaced_a_lost_one_takes_copies_back_one_per_pass():
    # a pod was lost: its models m5 and m6 went to p0 and p1, and its replacement p2 came up empty
    demands = [Demand(f"m{i}", "r", 1) for i in range(1, 7)]
    pods = [
        pod("p0", {"m1": "r", "m2": "r", "m5": "r"}),
        pod("p1", {"m3": "r", "m4": "r", "m6": "r"}),
        pod("p2"),
    ]
    plans = plan(demands, pods)
    moving = {name: p for name, p in plans.items() if p.load or p.unload}
    assert list(moving) == ["m3"]  # one copy per pass, from the fullest pod (p1 by name among equals)
    assert (moving["m3"].keep, moving["m3"].load, moving["m3"].unload) == ([], ["p2"], ["p1"])
    assert moving["m3"].revisions == {"p2": "r"}
    # the old copy goes only once the new one is loaded
    assert unloads_allowed(moving["m3"], demands[2], []) == []
    assert unloads_allowed(moving["m3"], demands[2], ["p2"]) == ["p1"]
    # while p1's copy waits to be unloaded (routed away first), nothing else moves and p2's copy is the one kept
    pods = [
        pod("p0", {"m1": "r", "m2": "r", "m5": "r"}),
        pod("p1", {"m3": "r", "m4": "r", "m6": "r"}),
        pod("p2", {"m3": "r"}),
    ]
    waiting = [
        Demand(d.name, "r", 1, draining=frozenset({"p1"}) if d.name == "m3" else frozenset()) for d in demands
    ]
    plans = plan(waiting, pods)
    assert (plans["m3"].keep, plans["m3"].unload) == (["p2"], ["p1"])
    assert all(not p.load and not p.unload for name, p in plans.items() if name != "m3")
    # the next settled pass moves one from p0; then 2/2/2 and nothing moves
    pods = [
        pod("p0", {"m1": "r", "m2": "r", "m5": "r"}),
        pod("p1", {"m4": "r", "m6": "r"}),
        pod("p2", {"m3": "r"}),
    ]
    plans = plan(demands, pods)
    assert [(n, p.load, p.unload) for n, p in plans.items() if p.load or p.unload] == [("m1", ["p2"], ["p0"])]
    pods = [
        pod("p0", {"m2": "r", "m5": "r"}),
        pod("p1", {"m4": "r", "m6": "r"}),
        pod("p2", {"m1": "r", "m3": "r"}),
    ]
    assert all(not p.load and not p.unload for p in plan(demands, pods).values())


def test_rebalancing_waits_for_a_settled_pool_and_keeps_its_rules():
    demands = [Demand(f"m{i}", "r", 1) for i in range(1, 5)]
    full = [pod("a", {"m1": "r", "m2": "r", "m3": "r"}), pod("b", {"m4": "r"})]
    # a difference of one is balance enough
    assert all(
        not p.load
        for p in plan(
            demands, [pod("a", {"m1": "r", "m2": "r"}), pod("b", {"m3": "r"}), pod("c", {"m4": "r"})]
        ).values()
    )
    # another model loading somewhere: nothing moves in that pass
    plans = plan([*demands, Demand("new", "r", 1)], full + [pod("c", {"x": "r", "y": "r"})])
    assert [n for n, p in plans.items() if p.load or p.unload] == ["new"]
    # a rollout in progress: nothing moves
    assert all(not p.load for p in plan(demands, full + [pod("old", leaving=True)]).values())
    # canaries and a pod that failed to load the model are not moved (a's third model is not the operator's)
    pods = [pod("a", {"m2": "r", "m3": "r"}, loaded=3), pod("b", {"m4": "r"})]
    canary = Demand("m2", "r", 1, canary_revision="r2", canary_percent=0)
    plans = plan([canary, Demand("m3", "r", 1, avoid=frozenset({"b"})), demands[3]], pods)
    assert all(not p.load and not p.unload for p in plans.values())
    plans = plan([canary, Demand("m3", "r", 1), demands[3]], pods)
    assert (plans["m3"].load, plans["m3"].unload) == (["b"], ["a"])
    # no room on the emptiest pod: nothing moves
    assert all(
        not p.load
        for p in plan(demands, full + [pod("c", {"x": "r"}, loaded=1)], Capacity(max_models=1)).values()
    )
    # the move never puts two copies on one node where each node had one
    two = [Demand("m1", "r", 2), Demand("m2", "r", 1), Demand("m3", "r", 1)]
    pods = [
        pod("a", {"m1": "r", "m2": "r", "m3": "r"}, node="n1"),
        pod("b", {"m1": "r"}, node="n2"),
        pod("c", node="n2"),
    ]
    plans = plan(two, pods)
    assert plans["m1"].load == [] and plans["m2"].load == ["c"] and plans["m2"].unload == ["a"]


def test_of_two_copies_the_one_on_the_emptier_pod_is_kept():
    # a copy moved (rebalancing): the old pod, fuller, holds it too until its copy is unloaded
    pods = [pod("a", {"m": "r", "x": "r", "y": "r"}), pod("b", {"m": "r"})]
    result = plan([Demand("m", "r", 1), Demand("x", "r", 1), Demand("y", "r", 1)], pods)["m"]
    assert (result.keep, result.unload) == (["b"], ["a"])
