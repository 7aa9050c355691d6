"""One placement pass over a pool: read a snapshot of it (pool_snapshot.py), decide placements, load and unload
through the model-control API, then make pod labels, readiness gates and statuses tell the truth.

A pass is idempotent and starts from what the servers report, so the same code creates placements, heals pods
that restarted or were added by the autoscaler, rolls revisions, and cleans up after deleted models.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import timeline
from .control import ControlError
from .endpoint_slices import service_endpoints
from .events import post as post_event
from .group_status import read_group
from .kube import KubeError
from .llm_gauges import EngineGauges, copy_status
from .measured_memory import measured_memory, placement_memory
from .model_resources import ModelIntent, endpoint, grouped, model_selector_string
from .naming import API_VERSION, MODEL_KIND, SERVER_KIND, headless_service_name
from .observe import (
    Held,
    PodFacts,
    PodTruth,
    gate_patch,
    highest_version,
    metadata_patch,
    pod_facts,
    ready_entries,
)
from .oom_kills import load_oom
from .ownership import pool_selector_string
from .placement import Capacity, Demand, Plan, PodState, plan_pool, unloads_allowed
from .pool_snapshot import PoolContext, PoolModel, PoolSnapshot, read_pool
from .pool_wake import KEDA_SCALES, pool_scales_to_zero
from .quantity import quantity_bytes
from .scale_to_zero import ZeroDecision, decide, model_requests
from .security import tls_secret_name
from .server_spec import autoscaling_active, desired_replicas, server_spec_problems
from .status import (
    ModelCount,
    ModelObservation,
    Placement,
    merged_status,
    model_status,
    now_rfc3339,
    server_status,
    status_changes,
)

log = logging.getLogger(__name__)
_KEEP = ZeroDecision(scaled=False)  # a model that cannot scale to zero
# Model status writes in flight at once during a pass.
STATUS_WRITES = 16


@dataclass
class PoolReport:
    found: bool
    # InferenceModel name -> pods that still hold it after the pass.
    holders: dict[str, list[str]] = field(default_factory=dict)
    # InferenceModel name -> pods among its holders that are no longer routed and wait to be unloaded.
    draining: dict[str, list[str]] = field(default_factory=dict)
    # Seconds until the next pass should finish those unloads (None: none pending).
    recheck_in: float | None = None


async def _patch_pod(
    ctx: PoolContext, namespace: str, facts: PodFacts, truth: PodTruth, now: str
) -> PodFacts:
    """Write labels, annotations and the readiness gate; returns the pod as it is afterwards."""
    latest = None
    try:
        patch = metadata_patch(facts, truth)
        if patch is not None:
            latest = await ctx.kube.patch("v1", "Pod", namespace, facts.name, patch)
        if truth.gate is not None:
            message = (
                f"{len(truth.held)} models loaded" if truth.gate else "the server restarted; reloading models"
            )
            gate = gate_patch(facts, truth.gate, now, message)
            if gate is not None:
                latest = await ctx.kube.patch(
                    "v1", "Pod", namespace, facts.name, gate, subresource="status", patch_type="strategic"
                )
    except KubeError as error:
        if error.status != 404:  # a pod that went away has nothing left to say
            raise
    return pod_facts(latest) if latest else facts


def _capacity(spec: Mapping[str, Any]) -> Capacity:
    capacity = spec.get("capacity") or {}
    try:
        memory = quantity_bytes(capacity.get("memory")) or None
    except ValueError:
        memory = None
    return Capacity(max_models=capacity.get("maxModels"), memory=memory)


class _Pass:
    """The steps of one pass over a snapshot of its pool, and what they did (loads, unloads, failures)."""

    def __init__(self, ctx: PoolContext, snapshot: PoolSnapshot):
        self.ctx = ctx
        self.snap = snapshot
        self.namespace = snapshot.namespace
        self.pool = snapshot.pool
        self.now = snapshot.now
        self._tls = tls_secret_name(snapshot.spec) is not None
        self.facts = list(snapshot.facts)  # the pods as the pass's own patches leave them
        # pod -> model name -> READY versions, read once per pass (not once per model and pod).
        self.ready = {f.name: ready_entries(snapshot.index[f.name] or []) for f in snapshot.facts}
        self.truth = self._initial_truth()  # what each pod holds, kept current as the pass loads and unloads
        self.failures: dict[str, dict[str, str]] = {}  # model -> pod -> load error in this pass
        self.unload_failures: dict[str, dict[str, str]] = {}
        self.fresh: set[tuple[str, str]] = set()  # (model, pod) loaded in this pass
        self.drained: set[tuple[str, str]] = set()  # (pod, model) no longer routed, waiting to be unloaded
        if ctx.drain is not None:  # pods patched early in the pass (lost models, routes) stay unrouted too
            for name, pods in ctx.drain.draining(self.namespace, self.pool).items():
                for pod in pods & self.truth.keys():
                    self.truth[pod].unrouted.add(name)

    async def run(self) -> PoolReport:
        snap = self.snap
        models, spec = snap.models, snap.spec
        await self._drop_lost_models()

        valid = [m for m in models if not m.problems]
        zero = await self._scale_to_zero(valid)
        if any(d.went for d in zero.values()):
            await self._patch_routes()  # the Service selects the on-demand pods before the copies go
        measured = measured_memory(snap.index)
        draining = self.ctx.drain.draining(self.namespace, self.pool) if self.ctx.drain is not None else {}
        demands = {
            m.intent.name: Demand(
                name=m.intent.name,
                revision=m.intent.revision,
                replicas=0
                if m.deleting or zero.get(m.intent.name, _KEEP).scaled
                else m.intent.wanted_replicas,
                memory=placement_memory(m.intent.memory, m.intent.model_name, measured),
                avoid=frozenset(self._avoid(m.intent)),
                canary_revision=m.intent.canary.revision if m.intent.canary else None,
                canary_percent=m.intent.canary.percent if m.intent.canary else 0,
                draining=frozenset(draining.get(m.intent.name, ())),
            )
            for m in valid
        }
        plans = plan_pool(list(demands.values()), list(snap.states.values()), _capacity(spec))

        loading = []
        for model in valid:
            if plans[model.intent.name].load and not model.deleting:
                observed = self._observe(model, plans[model.intent.name], loading=True)
                self._zero_fields(observed, model, zero)
                if model.intent.canary is not None:  # traffic figures come after the loads
                    observed.variants = (model.body.get("status") or {}).get("variants")
                loading.append((model, observed))
        tag = f"pool:{self.pool}"
        timeline.mark(self.namespace, tag, "planned", f"loads={sum(len(p.load) for p in plans.values())}")
        loaded = await self._load_all(valid, plans, loading)
        timeline.mark(self.namespace, tag, "loaded")
        await self._unload_all(valid, plans, demands, loaded)
        await self._unload_strays()
        for pod, truth in self.truth.items():  # copies kept after all are routed again
            truth.unrouted = {name for p, name in self.drained if p == pod}

        for facts in self.facts:
            if snap.states[facts.name].ready:
                self.truth[facts.name].gate = True
        await asyncio.gather(
            *(_patch_pod(self.ctx, self.namespace, f, self.truth[f.name], self.now) for f in self.facts)
        )
        timeline.mark(self.namespace, tag, "pods-patched")

        traffic = await self._read_traffic(models)
        gauges = await self._read_gauges(models)
        counts = []
        observations = []
        for model in models:
            if model.deleting:
                continue
            observed = self._observe(model, plans.get(model.intent.name), loading=False)
            observed.variants = self._variants(model, traffic)
            observed.copies = self._copies(model, gauges)
            self._zero_fields(observed, model, zero)
            if model.intent.dedicated and not model.intent.suspended and not model.problems:
                observed.wanted = max(observed.wanted, desired_replicas(spec))
            observations.append((model, observed))
            counts.append(ModelCount(model.intent.name, model.intent.model_name, observed.holding))
        await self._write_model_statuses(observations)
        timeline.mark(self.namespace, tag, "statuses", str(len(observations)))
        await self._write_server_status(counts)
        timeline.mark(self.namespace, tag, "pass-end")
        holders: dict[str, list[str]] = {}
        for pod, truth in self.truth.items():
            for name in truth.held:
                holders.setdefault(name, []).append(pod)
        report = PoolReport(found=True, holders=holders)
        if self.ctx.drain is not None:
            self.ctx.drain.retain(self.namespace, self.pool, self.drained)
            report.recheck_in = self.ctx.drain.recheck_in(self.namespace, self.pool)
            for pod, name in sorted(self.drained):
                report.draining.setdefault(name, []).append(pod)
        return report

    # --- steps ------------------------------------------------------------------------------------------------

    def _on_demand_pods(self) -> tuple[list[PodFacts], int]:
        """Ready pods that run with --load-on-demand, and how many ready pods do not."""
        ready = [f for f in self.facts if self.snap.states[f.name].ready]
        on_demand = [f for f in ready if f.load_on_demand]
        return on_demand, len(ready) - len(on_demand)

    async def _scale_to_zero(self, models: Sequence[PoolModel]) -> dict[str, ZeroDecision]:
        """For each model with minReplicas 0: whether it keeps its copies, gives them up (idle for idleSeconds:
        its request counters on the pods holding it did not move) or comes back (a pod loaded it on demand).
        A model scaled to zero is routed to every on-demand pod (`PodTruth.routes`)."""
        clock = self.ctx.idle
        for model in models:
            if model.deleting or not model.intent.scales_to_zero:
                clock.forget(self.namespace, model.intent.name)
        candidates = [m for m in models if m.intent.scales_to_zero and not m.deleting]
        if not candidates:
            return {}
        on_demand, others = self._on_demand_pods()
        holders = {
            m.intent.name: [
                self.snap.states[f.name].ip or ""
                for f in self.facts
                if self.snap.states[f.name].ready and m.intent.name in self.snap.states[f.name].held
            ]
            for m in candidates
        }
        scaled_before = {
            m.intent.name: clock.scaled(self.namespace, m.intent.name, m.body.get("status"))
            for m in candidates
        }
        wanted_ips = {
            ip for m in candidates if not scaled_before[m.intent.name] for ip in holders[m.intent.name]
        }
        meter = self.ctx.meter
        counters = await meter.scrape_all(ip for ip in wanted_ips if ip) if meter is not None else {}
        decisions = {}
        for model in candidates:
            intent = model.intent
            idle_for = None
            if not scaled_before[intent.name] and meter is not None:
                if holders[intent.name]:
                    requests = model_requests(counters, holders[intent.name], intent.model_name)
                    idle_for = clock.idle_for(self.namespace, intent.name, requests)
                else:  # no copy is ready (being placed or loaded): its idle time counts from the first ready copy
                    clock.forget(self.namespace, intent.name)
            decision = decide(
                scaled_before=scaled_before[intent.name],
                holders=len(holders[intent.name]),
                on_demand_pods=len(on_demand),
                other_pods=others,
                idle_seconds=intent.idle_seconds,
                idle_for=idle_for,
            )
            # (a model found at zero in its status, by an operator that restarted, is remembered here too)
            known_scaled = clock.scaled(self.namespace, intent.name, None)
            if decision.went or decision.woke or (decision.scaled and not known_scaled):
                clock.set_scaled(self.namespace, intent.name, decision.scaled)
            if decision.went:
                post_event(
                    model.body,
                    "Normal",
                    "ScaledToZero",
                    f"no request for {intent.idle_seconds}s: unloading every copy; {len(on_demand)} pods of "
                    f"{self.pool} load it on the next request",
                )
            elif decision.woke:
                where = ", ".join(f.name for f in self.facts if intent.name in self.snap.states[f.name].held)
                post_event(
                    model.body,
                    "Normal",
                    "ScaledFromZero",
                    f"loaded on demand on {where}: placing its copies again"
                    if where
                    else "no pod of the pool can load it on demand: placing its copies again",
                )
            if decision.scaled:
                for facts in on_demand:
                    self.truth[facts.name].routes.add(intent.name)
            decisions[intent.name] = decision
        return decisions

    async def _patch_routes(self) -> None:
        """Label the on-demand pods for the models going to zero now, before their copies are unloaded."""

        async def patch(i: int, facts: PodFacts) -> None:
            self.facts[i] = await _patch_pod(
                self.ctx, self.namespace, facts, self.truth[facts.name], self.now
            )

        await asyncio.gather(*(patch(i, f) for i, f in enumerate(self.facts) if self.truth[f.name].routes))

    def _zero_fields(
        self, observed: ModelObservation, model: PoolModel, zero: Mapping[str, ZeroDecision]
    ) -> None:
        decision = zero.get(model.intent.name)
        if decision is None:
            return
        observed.scaled_to_zero = decision.scaled
        observed.on_demand_pods = len(self._on_demand_pods()[0])
        observed.idle_seconds = model.intent.idle_seconds

    def _avoid(self, intent: ModelIntent) -> dict[str, str]:
        """Pods waiting out a failed load of one of the model's revisions (stable or canary)."""
        avoid: dict[str, str] = {}
        for revision in intent.revisions:
            avoid.update(self.ctx.backoff.avoid(self.namespace, intent.name, revision))
        return avoid

    def _initial_truth(self) -> dict[str, PodTruth]:
        """What each pod holds now: for pods the pass can read, what their index says; for the others, what was
        recorded (unless the server restarted, which loses every model)."""
        by_name = {m.intent.name: m.intent for m in self.snap.models}
        truth = {}
        for facts in self.facts:
            state = self.snap.states[facts.name]
            index = self.snap.index[facts.name]
            if index is not None:
                held = {
                    name: Held(by_name[name].model_name, revision) for name, revision in state.held.items()
                }
                # Records of models no longer bound to this pool stay until they are unloaded (_unload_strays).
                for name, record in facts.recorded.items():
                    if name not in by_name and not facts.restarted:
                        held[name] = record
            elif facts.restarted:
                held = {}
            else:
                held = dict(facts.recorded)
            truth[facts.name] = PodTruth(
                held=held, restarts=facts.restarts, gate=False if facts.restarted else None
            )
        return truth

    async def _drop_lost_models(self) -> None:
        """Before any slow load: pods whose labels promise models they lost (restart, crash) stop receiving
        that model's traffic now."""

        async def drop(i: int, facts: PodFacts) -> None:
            truth = self.truth[facts.name]
            lost = [n for n in facts.recorded if n not in truth.held]
            if lost or facts.restarted:
                self.facts[i] = await _patch_pod(self.ctx, self.namespace, facts, truth, self.now)

        await asyncio.gather(*(drop(i, facts) for i, facts in enumerate(self.facts)))

    async def _load_one(self, model: PoolModel, pod: PodState, revision: str) -> tuple[str, str, str | None]:
        intent = model.intent
        _, config, _ = intent.variant(revision)
        try:
            async with self.ctx.load_slots:
                timeline.mark(self.namespace, intent.name, "load-start", pod.name)
                await self.snap.control.load(pod.ip or "", intent.model_name, config)
        except ControlError as error:
            return intent.name, pod.name, str(error)
        finally:
            timeline.mark(self.namespace, intent.name, "load-end", pod.name)
        return intent.name, pod.name, None

    async def _load_all(
        self,
        models: Sequence[PoolModel],
        plans: Mapping[str, Plan],
        loading: Sequence[tuple[PoolModel, ModelObservation]] = (),
    ) -> dict[str, set[str]]:
        """Run the planned loads (at most `load_slots` at once); the models in `loading` whose loads are still
        running after `loading_status_delay` get a `Loading` status meanwhile (a load that answers sooner, the
        usual case, goes straight to its final status: one status write, not two)."""
        by_name = {m.intent.name: m for m in models}
        running = {
            name: len(plan.load) for name, plan in plans.items() if plan.load
        }  # loads not yet answered

        async def job(name: str, pod: str) -> tuple[str, str, str | None]:
            try:
                return await self._load_one(
                    by_name[name],
                    self.snap.states[pod],
                    plans[name].revisions.get(pod, by_name[name].intent.revision),
                )
            finally:
                running[name] -= 1

        jobs = asyncio.gather(*(job(name, pod) for name, plan in plans.items() for pod in plan.load))
        try:
            if loading:
                done, _ = await asyncio.wait({jobs}, timeout=self.ctx.loading_status_delay)
                if not done:
                    slow = [(m, o) for m, o in loading if running.get(m.intent.name, 0) > 0]
                    await self._write_model_statuses(slow)
                    timeline.mark(self.namespace, f"pool:{self.pool}", "loading-statuses", str(len(slow)))
            results = await jobs
        except BaseException:
            jobs.cancel()  # the pass was cancelled or a status write failed: no loads left running unowned
            raise
        loaded: dict[str, set[str]] = {}
        for name, pod, error in results:
            model = by_name[name]
            intent = model.intent
            revision = plans[name].revisions.get(pod, intent.revision)
            variant = intent.variant(revision)[0]
            if error is None:
                self.truth[pod].held[name] = Held(intent.model_name, revision)
                self.fresh.add((name, pod))
                self.ctx.backoff.succeeded(self.namespace, pod, name, revision)
                loaded.setdefault(name, set()).add(pod)
                post_event(
                    model.body,
                    "Normal",
                    "Loaded",
                    f"loaded {intent.model_name} (revision {revision}"
                    + (", canary" if variant == "canary" else "")
                    + f") on pod {pod}",
                )
            else:
                self.ctx.backoff.failed(self.namespace, pod, name, revision, error)
                self.failures.setdefault(name, {})[pod] = error
                post_event(
                    model.body, "Warning", "LoadFailed", f"loading {intent.model_name} on pod {pod}: {error}"
                )
        return loaded

    async def _unload(self, pod: str, model_name: str) -> str | None:
        ip = self.snap.states[pod].ip
        try:
            await self.snap.control.unload(ip or "", model_name)
        except ControlError as error:
            return str(error)
        return None

    async def _routed_away(self, name: str, pods: Sequence[str], staying: Sequence[str]) -> list[str]:
        """Route first, unload after (draining.py): of the copies of InferenceModel `name` to unload, those whose
        pods its Services no longer route to. The others lose their label in this pass and wait for a later one.
        A copy is routed away only once a copy that stays (`staying`) is in the Services' endpoints: a copy moving
        to another pod keeps its old pod routed until the new one is listed, so the Service is never without one."""
        book = self.ctx.drain
        if book is None or not pods:
            return list(pods)
        endpoints: list[set[str] | None] = []

        async def listed() -> set[str] | None:
            if not endpoints:
                endpoints.append(
                    await service_endpoints(
                        self.ctx.kube, self.namespace, (name, headless_service_name(name))
                    )
                )
            return endpoints[0]

        def lists(found: set[str] | None, pod: str) -> bool | None:
            ip = self.snap.states[pod].ip
            return None if found is None else (pod in found or (ip is not None and ip in found))

        now, waiting = [], []
        for pod in pods:
            truth = self.truth[pod]
            if name in truth.routes:
                now.append(pod)  # routed either way: the pod loads the model on demand (scale_to_zero.py)
                continue
            if staying and not book.pending(self.namespace, self.pool, pod, name):
                found = await listed()
                if found is not None and not any(lists(found, other) for other in staying):
                    continue  # no copy that stays is routed yet: this one keeps serving (a later pass looks again)
            truth.unrouted.add(name)
            self.drained.add((pod, name))
            if not book.start(self.namespace, self.pool, pod, name):
                waiting.append(pod)
        if waiting:
            found = await listed()
            for pod in waiting:
                if book.unload_now(self.namespace, self.pool, pod, name, lists(found, pod)):
                    now.append(pod)
        return now

    def _unloaded(self, pod: str, name: str) -> None:
        self.truth[pod].held.pop(name, None)
        self.truth[pod].unrouted.discard(name)
        self.drained.discard((pod, name))
        if self.ctx.drain is not None:
            self.ctx.drain.finish(self.namespace, self.pool, pod, name)

    async def _unload_all(
        self,
        models: Sequence[PoolModel],
        plans: Mapping[str, Plan],
        demands: Mapping[str, Demand],
        loaded: Mapping[str, set[str]],
    ) -> None:
        for model in models:
            name = model.intent.name
            allowed = unloads_allowed(plans[name], demands[name], loaded.get(name, set()))
            staying = [p for p in plans[name].chosen if p not in allowed]
            pods = await self._routed_away(name, allowed, staying)
            errors = await asyncio.gather(*(self._unload(pod, model.intent.model_name) for pod in pods))
            for pod, error in zip(pods, errors):
                if error is None:
                    self._unloaded(pod, name)
                    post_event(
                        model.body, "Normal", "Unloaded", f"unloaded {model.intent.model_name} from pod {pod}"
                    )
                else:
                    self.unload_failures.setdefault(name, {})[pod] = error
                    post_event(
                        model.body,
                        "Warning",
                        "UnloadFailed",
                        f"unloading {model.intent.model_name} from pod {pod}: {error}",
                    )

    async def _unload_strays(self) -> None:
        """Models recorded on a pod by an InferenceModel that is gone (or moved to another pool)."""
        bound = {m.intent.name for m in self.snap.models}
        strays: dict[str, list[str]] = {}  # InferenceModel name -> pods
        for facts in self.facts:
            state, truth = self.snap.states[facts.name], self.truth[facts.name]
            if not state.ready:
                continue
            in_use = {h.model_name for n, h in truth.held.items() if n in bound}
            for name, record in list(truth.held.items()):
                if name in bound:
                    continue
                if record.model_name in in_use:
                    truth.held.pop(name)  # another InferenceModel serves that model here now: only forget it
                    continue
                strays.setdefault(name, []).append(facts.name)
        for name, pods in strays.items():
            for pod in await self._routed_away(name, pods, ()):
                record = self.truth[pod].held[name]
                error = await self._unload(pod, record.model_name)
                if error is None:
                    self._unloaded(pod, name)
                    log.info("pod %s: unloaded %s, left by InferenceModel %s", pod, record.model_name, name)
                else:
                    log.warning(
                        "pod %s: unloading %s (InferenceModel %s is gone): %s",
                        pod,
                        record.model_name,
                        name,
                        error,
                    )

    # --- status -----------------------------------------------------------------------------------------------

    def _observe(self, model: PoolModel, plan: Plan | None, loading: bool) -> ModelObservation:
        intent = model.intent
        placements = []
        holding = available = 0
        avoid = self._avoid(intent)
        planned = set(plan.load) if plan is not None and loading else set()
        eligible = 0
        for facts in self.facts:
            pod = facts.name
            state, held = self.snap.states[pod], self.truth[pod].held.get(intent.name)
            eligible += 1 if state.ready else 0
            version = highest_version(self.ready[pod].get(intent.model_name) or [])
            variant = intent.variant(held.revision)[0] if held is not None and intent.canary else None
            if held is not None and (intent.name, pod) in self.fresh:
                version = intent.variant(held.revision)[2] or version  # the index was read before this load
            failure = self.failures.get(intent.name, {}).get(pod)
            unload_failure = self.unload_failures.get(intent.name, {}).get(pod)
            if pod in planned:
                placements.append(
                    Placement(
                        pod,
                        "Loading",
                        facts.ip,
                        version,
                        "reloading a new revision" if held is not None else None,
                    )
                )
                if held is not None:
                    holding += 1
                continue
            if held is not None:
                holding += 1
                current = held.revision in intent.revisions
                unrouted = intent.name in self.truth[pod].unrouted
                if current and state.ready and not unrouted:
                    available += 1
                message = unload_failure or failure or (None if current else "older revision; reload pending")
                if unrouted and message is None:
                    message = "no longer routed here; unloading once the Service's endpoints drop the pod"
                placements.append(
                    Placement(
                        pod,
                        "Unloading" if unload_failure or unrouted else "Loaded",
                        facts.ip,
                        version,
                        message,
                        variant=variant if current else None,
                    )
                )
            elif failure is not None or pod in avoid:
                placements.append(Placement(pod, "Failed", facts.ip, None, failure or avoid.get(pod)))
        last_failure = None
        for pod, message in self.failures.get(intent.name, {}).items():
            last_failure = {"time": self.now, "pod": pod, "message": message}
        failed_pods = set(self.failures.get(intent.name, {})) | set(avoid)
        return ModelObservation(
            wanted=plan.wanted if plan is not None else 0,
            holding=holding,
            available=available,
            placements=placements,
            shortfall=plan.shortfall if plan is not None else 0,
            loading=loading and bool(planned),
            failure=last_failure,
            retrying={
                pod: message
                for pod, message in avoid.items()
                if pod not in self.failures.get(intent.name, {})
            },
            eligible_pods=eligible,
            oom_killed=load_oom(self.snap.oom_kills, failed_pods, intent.model_name),
        )

    async def _read_traffic(self, models: Sequence[PoolModel]) -> dict[str, dict[str, tuple[float, float]]]:
        """Request counters of the pods holding a model under a canary (pod IP -> model name -> counters)."""
        if self.ctx.meter is None:
            return {}
        canaried = {m.intent.name for m in models if m.intent.canary is not None and not m.deleting}
        ips = [
            self.snap.states[f.name].ip or ""
            for f in self.facts
            if self.snap.states[f.name].ready and any(n in canaried for n in self.truth[f.name].held)
        ]
        return await self.ctx.meter.scrape_all(ip for ip in ips if ip)

    async def _read_gauges(self, models: Sequence[PoolModel]) -> dict[str, dict[str, EngineGauges]]:
        """The LLM gauges of the ready pods holding an LLM model (pod IP -> model name -> gauges)."""
        if self.ctx.gauges is None:
            return {}
        llms = {m.intent.name for m in models if m.intent.llm is not None and not m.deleting}
        ips = [
            self.snap.states[f.name].ip or ""
            for f in self.facts
            if self.snap.states[f.name].ready and any(n in llms for n in self.truth[f.name].held)
        ]
        return await self.ctx.gauges.read_all(ip for ip in ips if ip)

    def _copies(
        self, model: PoolModel, gauges: Mapping[str, Mapping[str, EngineGauges]]
    ) -> list[dict[str, Any]] | None:
        """status.copies of an LLM model: each ready pod holding its current revision, with its gauges."""
        intent = model.intent
        if intent.llm is None:
            return None
        copies = []
        for facts in self.facts:
            held = self.truth[facts.name].held.get(intent.name)
            state = self.snap.states[facts.name]
            if held is None or held.revision not in intent.revisions or not state.ready:
                continue
            reading = gauges.get(state.ip or "")
            copies.append(
                copy_status(facts.name, reading.get(intent.model_name) if reading is not None else None)
            )
        return sorted(copies, key=lambda c: str(c["pod"]))

    def _variants(
        self, model: PoolModel, traffic: Mapping[str, Mapping[str, tuple[float, float]]]
    ) -> list[dict[str, Any]] | None:
        """status.variants of a model under a canary: each variant's pods, share and traffic."""
        intent = model.intent
        meter = self.ctx.meter
        if intent.canary is None:
            if meter is not None:
                meter.forget(self.namespace, intent.name)
            return None
        holders: dict[str, list[str]] = {revision: [] for revision in intent.revisions}
        for facts in self.facts:
            held = self.truth[facts.name].held.get(intent.name)
            if held is not None and held.revision in holders and self.snap.states[facts.name].ready:
                holders[held.revision].append(facts.name)
        total = sum(len(pods) for pods in holders.values())
        out = []
        for revision, pods in holders.items():
            name, _, version = intent.variant(revision)
            entry: dict[str, Any] = {
                "name": name,
                "revision": revision,
                "replicas": len(pods),
                "pods": sorted(pods),
                "trafficPercent": round(100 * len(pods) / total) if total else 0,
            }
            if version is not None:
                entry["version"] = version
            if meter is not None:
                counters = [
                    traffic[ip][intent.model_name]
                    for ip in (self.snap.states[p].ip for p in pods)
                    if ip is not None and ip in traffic and intent.model_name in traffic[ip]
                ]
                figures = meter.traffic(self.namespace, intent.name, revision, counters)
                entry["requests"] = figures.requests
                entry["failures"] = figures.failures
                if figures.request_rate is not None:
                    entry["requestRate"] = round(figures.request_rate, 3)
                    entry["failureRate"] = round(figures.failure_rate or 0.0, 3)
            out.append(entry)
        if meter is not None:
            meter.forget(self.namespace, intent.name, keep=intent.revisions)
        return out

    async def _write_model_statuses(self, observations: Sequence[tuple[PoolModel, ModelObservation]]) -> None:
        """Write the statuses that changed, several at a time (a pass over a pool of many models otherwise waits
        on one round trip per model)."""
        slots = asyncio.Semaphore(STATUS_WRITES)

        async def write(model: PoolModel, observed: ModelObservation) -> None:
            async with slots:
                await write_model_status(
                    self.ctx, self.namespace, self.now, model, observed, pool_found=True, tls=self._tls
                )

        await asyncio.gather(*(write(model, observed) for model, observed in observations))

    async def _write_server_status(self, counts: Sequence[ModelCount]) -> None:
        snap = self.snap
        spec, meta = snap.spec, snap.server["metadata"]
        # a pool at zero pods without its own HPA: KEDA's (the operator keeps its HPA while KEDA is missing)
        keda = pool_scales_to_zero(spec) and snap.hpa is None
        status = server_status(
            generation=meta.get("generation"),
            selector=pool_selector_string(self.pool),
            desired=desired_replicas(spec),
            deployment=snap.deployment,
            hpa=snap.hpa,
            hpa_wanted=autoscaling_active(spec),
            autoscaler_delegated_to=KEDA_SCALES if keda else None,
            models=counts,
            problems=server_spec_problems(self.pool, spec),
            old_conditions=(self.snap.server.get("status") or {}).get("conditions"),
            now=self.now,
        )
        if not status_changes(self.snap.server.get("status"), status):
            return
        try:
            await self.ctx.kube.apply_status(API_VERSION, SERVER_KIND, self.namespace, self.pool, status)
        except KubeError as error:
            if error.status != 404:
                raise


async def write_model_status(
    ctx: PoolContext,
    namespace: str,
    now: str,
    model: PoolModel,
    observed: ModelObservation,
    pool_found: bool,
    tls: bool,
) -> None:
    intent, meta = model.intent, model.body["metadata"]
    status = model_status(
        generation=meta.get("generation"),
        pool=intent.pool,
        model_name=intent.model_name,
        revision=intent.revision,
        selector=model_selector_string(intent),
        endpoint=endpoint(intent, namespace, tls),
        problems=model.problems,
        suspended=intent.suspended,
        pool_found=pool_found,
        observed=observed,
        old_status=model.body.get("status"),
        now=now,
    )
    if not status_changes(model.body.get("status"), status):
        return  # a steady state writes nothing
    try:
        await ctx.kube.apply_status(API_VERSION, MODEL_KIND, namespace, meta["name"], status)
    except KubeError as error:
        if error.status != 404:
            raise
    timeline.mark(namespace, meta["name"], "status", str(status.get("phase")))
    model.body["status"] = merged_status(model.body.get("status"), status)


async def reconcile_pool(ctx: PoolContext, namespace: str, pool: str) -> PoolReport:
    """Run one pass over the pool `pool` in `namespace`: read it, then act on what was read."""
    now = now_rfc3339()
    timeline.mark(namespace, f"pool:{pool}", "pass-start")
    models, snapshot = await read_pool(ctx, namespace, pool, now)
    timeline.mark(namespace, f"pool:{pool}", "read", f"models={len(models)}")
    if snapshot is None:
        for model in models:
            if not model.deleting and grouped(model.intent) and not model.problems:
                # no pool: the model's LeaderWorkerSet runs it (its leaders load it at start)
                wanted = 0 if model.intent.suspended else desired_replicas(model.body.get("spec") or {})
                observed = await read_group(ctx.kube, ctx.gauges, namespace, model.intent, wanted)
                await write_model_status(ctx, namespace, now, model, observed, pool_found=True, tls=False)
            elif not model.deleting:
                await write_model_status(
                    ctx,
                    namespace,
                    now,
                    model,
                    ModelObservation(wanted=0, holding=0, available=0),
                    pool_found=False,
                    tls=False,
                )
        return PoolReport(found=False)
    return await _Pass(ctx, snapshot).run()
