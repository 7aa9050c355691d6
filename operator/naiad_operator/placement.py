"""Pure placement decisions: given the pods of a pool (ready state, what they hold, capacity) and the models
that want replicas there, decide where each model is kept, loaded and unloaded.

Rules, in order: a model stays where it already is with the right revision; a stale copy is reloaded in place;
new copies go to pods that have room and hold the fewest models; pods leaving in a rollout are a last resort.
Copies beyond the wanted count are unloaded, but only after the new copies loaded (see `unloads_allowed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PodState:
    name: str
    ip: str | None
    # Server container ready, index answered, pod not terminating: the operator can load into it.
    ready: bool
    # Belongs to a ReplicaSet the Deployment is rolling away from.
    leaving: bool = False
    # InferenceModel name -> revision it holds, READY on the server ("" when the revision is unknown).
    held: Mapping[str, str] = field(default_factory=dict)
    # Models READY on the server in total, whoever loaded them (they all take a slot and memory).
    loaded_count: int = 0
    # The node the pod runs on: copies of one model go to different nodes first, so one node's drain never
    # takes all of them.
    node: str | None = None


@dataclass(frozen=True)
class Demand:
    name: str
    revision: str
    # None: every pod of the pool (a dedicated pool); 0: nowhere (suspended or being deleted).
    replicas: int | None
    memory: int = 0
    # Pods where loading this revision failed recently; no new attempt there until the back-off passes.
    avoid: frozenset[str] = frozenset()
    # A canary: this revision on `canary_percent` of the model's copies (see canary_count), `revision` on the rest.
    canary_revision: str | None = None
    canary_percent: int = 0
    # Pods whose copy is waiting to be unloaded (no longer routed: draining.py): kept only when no other copy
    # will do, ahead of loading a new one.
    draining: frozenset[str] = frozenset()

    @property
    def revisions(self) -> tuple[str, ...]:
        return (self.revision,) if self.canary_revision is None else (self.revision, self.canary_revision)


@dataclass(frozen=True)
class Capacity:
    max_models: int | None = None
    memory: int | None = None


@dataclass
class Plan:
    keep: list[str] = field(default_factory=list)  # hold the right revision and stay
    load: list[str] = field(default_factory=list)  # load (new copy) or reload (stale revision)
    unload: list[str] = field(default_factory=list)  # surplus copies, unloaded after the loads succeed
    shortfall: int = 0  # wanted copies no pod could take
    # Revision each kept or loaded pod holds afterwards (the canary's on its share of the pods).
    revisions: dict[str, str] = field(default_factory=dict)

    @property
    def chosen(self) -> list[str]:
        return self.keep + self.load

    @property
    def wanted(self) -> int:
        return len(self.keep) + len(self.load) + self.shortfall


class _Ledger:
    """Slots and memory taken on each pod, updated as a pass places models so later models see earlier ones."""

    def __init__(self, pods: Sequence[PodState], demands: Sequence[Demand], capacity: Capacity):
        memory_of = {d.name: d.memory for d in demands}
        self.capacity = capacity
        self.count = {p.name: max(p.loaded_count, len(p.held)) for p in pods}
        self.memory = {p.name: sum(memory_of.get(m, 0) for m in p.held) for p in pods}

    def has_room(self, pod: str, memory: int) -> bool:
        if self.capacity.max_models is not None and self.count[pod] + 1 > self.capacity.max_models:
            return False
        return self.capacity.memory is None or self.memory[pod] + memory <= self.capacity.memory

    def take(self, pod: str, memory: int) -> None:
        self.count[pod] += 1
        self.memory[pod] += memory

    def give_back(self, pod: str, memory: int) -> None:
        self.count[pod] -= 1
        self.memory[pod] -= memory


def _plan_one(demand: Demand, pods: Sequence[PodState], ledger: _Ledger) -> Plan:
    eligible = sorted((p for p in pods if p.ready and p.ip), key=lambda p: p.name)
    holders = [p for p in eligible if demand.name in p.held]
    if demand.replicas == 0:
        return Plan(unload=[p.name for p in holders])

    def current(p: PodState) -> bool:
        return p.held.get(demand.name) in demand.revisions

    def empties(group: Iterable[PodState]) -> list[PodState]:
        candidates = [p for p in group if demand.name not in p.held and p.name not in demand.avoid]
        return sorted(candidates, key=lambda p: (ledger.count[p.name], ledger.memory[p.name], p.name))

    fresh = [p for p in eligible if not p.leaving]
    old = [p for p in eligible if p.leaving]
    routed = [p for p in fresh if p.name not in demand.draining]

    def fewest(group: Iterable[PodState]) -> list[PodState]:
        # copies beyond the wanted count go from the pods holding the most models (ties: by name), so a copy that
        # moved to an emptier pod (_rebalance) is the one kept while its old pod still holds it
        return sorted(group, key=lambda p: (ledger.count[p.name], p.name))

    tiers = [
        fewest(p for p in routed if demand.name in p.held and current(p)),
        fewest(p for p in routed if demand.name in p.held and not current(p)),
        [p for p in fresh if demand.name in p.held and p.name in demand.draining],
        empties(fresh),
        [p for p in old if demand.name in p.held and current(p)],
        [p for p in old if demand.name in p.held and not current(p)],
        empties(old),
    ]
    wanted = len(fresh) if demand.replicas is None else demand.replicas
    chosen: list[PodState] = []
    for tier_index, tier in enumerate(tiers):
        if demand.replicas is None and tier_index >= 4:
            # Every-pod models keep copies on leaving pods (below) but never add new ones there.
            break
        if tier_index in (3, 6):
            tier = _spread(tier, chosen)
        for pod in tier:
            if len(chosen) >= wanted:
                break
            if demand.name not in pod.held:
                if not ledger.has_room(pod.name, demand.memory):
                    continue
                ledger.take(pod.name, demand.memory)
            chosen.append(pod)
    if demand.replicas is None:
        # Copies on pods that are leaving keep serving until the pod goes; stale ones are brought up to date.
        chosen += [p for p in old if demand.name in p.held]
    else:
        chosen = _respread(demand, chosen, empties(fresh), ledger)
    chosen_names = {p.name for p in chosen}
    plan = Plan(
        shortfall=max(0, wanted - len([p for p in chosen if not (demand.replicas is None and p.leaving)]))
    )
    plan.revisions = _variants(demand, chosen)
    for pod in chosen:
        if pod.held.get(demand.name) == plan.revisions[pod.name]:
            plan.keep.append(pod.name)
        elif pod.name in demand.avoid:
            # A reload that failed recently: keep serving the copy it has until the back-off passes.
            plan.keep.append(pod.name)
        else:
            plan.load.append(pod.name)
    # A copy on a pod that is leaving in a rollout is not unloaded: it serves until the Deployment removes the pod
    # (the pod's preStop delay lets the Service forget it first), whereas unloading it now would answer 404 to
    # the requests kube-proxy still sends there until the label change reaches every node.
    plan.unload = [p.name for p in holders if p.name not in chosen_names and not p.leaving]
    return plan


def canary_count(copies: int, percent: int) -> int:
    """Copies that hold the canary: `percent` of them rounded, but at least one of each variant when there are two
    or more copies (a model with one copy gets the canary only at 100%)."""
    if copies <= 0 or percent <= 0:
        return 0
    if percent >= 100:
        return copies
    if copies == 1:
        return 0
    return min(max((copies * percent + 50) // 100, 1), copies - 1)


def _variants(demand: Demand, chosen: Sequence[PodState]) -> dict[str, str]:
    """Which revision each chosen pod should hold. The canary goes first to pods that already hold it, then to
    pods holding neither variant, and only then replaces stable copies, so changing the share moves few copies."""
    if demand.canary_revision is None:
        return {p.name: demand.revision for p in chosen}
    serving = [p for p in chosen if not (demand.replicas is None and p.leaving)]

    def rank(p: PodState) -> int:
        held = p.held.get(demand.name)
        return 0 if held == demand.canary_revision else 2 if held == demand.revision else 1

    canary = {p.name for p in sorted(serving, key=rank)[: canary_count(len(serving), demand.canary_percent)]}
    out = {}
    for pod in chosen:
        held = pod.held.get(demand.name)
        if pod.name in canary:
            out[pod.name] = demand.canary_revision
        elif pod not in serving and held in demand.revisions:
            out[pod.name] = held  # a copy on a pod that is leaving keeps serving what it has
        else:
            out[pod.name] = demand.revision
    return out


def _spread(candidates: list[PodState], chosen: Sequence[PodState]) -> list[PodState]:
    """Candidates reordered so that each next one is on the node with the fewest copies so far (chosen ones and
    those ahead of it), keeping the given order among equals (fewest models first)."""
    copies: dict[str | None, int] = {}
    for pod in chosen:
        copies[pod.node] = copies.get(pod.node, 0) + 1
    left = list(candidates)
    ordered = []
    while left:
        best = min(range(len(left)), key=lambda i: (copies.get(left[i].node, 0) if left[i].node else 0, i))
        pod = left.pop(best)
        ordered.append(pod)
        if pod.node:
            copies[pod.node] = copies.get(pod.node, 0) + 1
    return ordered


def _respread(
    demand: Demand, chosen: list[PodState], empty: Sequence[PodState], ledger: _Ledger
) -> list[PodState]:
    """Copies that share a node while a node with no copy has a ready pod with room: one copy moves there (the
    new one is loaded first, the old one unloaded once it is: `unloads_allowed`). Pods become ready one at a
    time, so the first copies of a model can land on one node before the other nodes' pods are up."""
    chosen = list(chosen)
    while True:
        copies: dict[str, int] = {}
        for pod in chosen:
            if pod.node:
                copies[pod.node] = copies.get(pod.node, 0) + 1
        crowded = [p for p in chosen if p.node and copies[p.node] > 1]
        target = next(
            (
                p
                for p in empty
                if p.node
                and p.node not in copies
                and p not in chosen
                and ledger.has_room(p.name, demand.memory)
            ),
            None,
        )
        if not crowded or target is None:
            return chosen
        # The copy to move: on the most crowded node, the one placement ranked last there.
        most = max(copies[p.node or ""] for p in crowded)
        moved = [p for p in crowded if copies[p.node or ""] == most][-1]
        chosen[chosen.index(moved)] = target
        ledger.take(target.name, demand.memory)
        if demand.name not in moved.held:
            ledger.give_back(moved.name, demand.memory)  # it was only planned, not loaded


def plan_pool(demands: Sequence[Demand], pods: Sequence[PodState], capacity: Capacity) -> dict[str, Plan]:
    """A plan per model. Demands earlier in the sequence are placed first (callers order by creation time), so a
    full pool turns newcomers away rather than evicting models that were there first. A settled pool whose pods
    hold uneven numbers of models moves one copy towards balance (`_rebalance`)."""
    ledger = _Ledger(pods, demands, capacity)
    plans = {demand.name: _plan_one(demand, pods, ledger) for demand in demands}
    _rebalance(demands, pods, plans, ledger)
    return plans


def _rebalance(
    demands: Sequence[Demand], pods: Sequence[PodState], plans: Mapping[str, Plan], ledger: _Ledger
) -> None:
    """One copy moves from the pod holding the most models to the one holding the fewest when they differ by two
    or more (a pod that replaced a lost one starts empty, while its models went to the others). Only in a settled
    pool: no rollout, no load, unload or unload-in-waiting anywhere, so moves never pile onto other changes and
    one pass makes at most one. The new copy is loaded first; the old one is unloaded once it is ready
    (`unloads_allowed`), routed away first like any surplus copy (draining.py), and later passes rank the routed
    new copy ahead of it. Every-pod models, canaries and pods that failed to load the model stay as they are."""
    serving = [p for p in pods if p.ready and p.ip]
    if any(p.leaving for p in serving) or any(d.draining for d in demands):
        return
    if any(plan.load or plan.unload for plan in plans.values()):
        return
    if len(serving) < 2:
        return
    by_count = sorted(serving, key=lambda p: (ledger.count[p.name], p.name))
    light, heavy = by_count[0], by_count[-1]
    if ledger.count[heavy.name] - ledger.count[light.name] < 2:
        return
    node_of = {p.name: p.node for p in serving}
    for demand in sorted(demands, key=lambda d: (d.memory, d.name)):
        plan = plans[demand.name]
        if demand.replicas is None or demand.canary_revision is not None or light.name in demand.avoid:
            continue
        if heavy.name not in plan.keep or light.name in plan.keep or demand.name in light.held:
            continue
        others = {node_of.get(p) for p in plan.keep if p != heavy.name}
        if light.node is not None and light.node in others and node_of.get(heavy.name) not in others:
            continue  # it would put two copies on one node where there was one on each
        if not ledger.has_room(light.name, demand.memory):
            continue
        plan.keep.remove(heavy.name)
        plan.unload.append(heavy.name)
        plan.load.append(light.name)
        plan.revisions.pop(heavy.name, None)
        plan.revisions[light.name] = demand.revision
        ledger.take(light.name, demand.memory)
        ledger.give_back(heavy.name, demand.memory)
        return


def unloads_allowed(plan: Plan, demand: Demand, loaded: Iterable[str]) -> list[str]:
    """Surplus copies to unload now: all of them when the model is going away, otherwise only once the copies
    the plan wanted are loaded (load before unload, so capacity never dips below what was serving)."""
    if demand.replicas == 0:
        return list(plan.unload)
    loaded_set = set(loaded)
    if all(pod in loaded_set for pod in plan.load):
        return list(plan.unload)
    return []
