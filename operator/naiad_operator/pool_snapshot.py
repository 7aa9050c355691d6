"""What a placement pass reads of its pool before deciding anything: the InferenceServer, its InferenceModels (each
with the problems that keep it from loading), the pods, and every server's repository index."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import OperatorConfig
from .control import ControlError, IndexEntry, ModelControlClient
from .draining import DrainBook
from .kube import KubeClient
from .llm_gauges import GaugeReader
from .load_backoff import LoadBackoff
from .model_resources import ModelIntent, model_intent, pool_problems
from .naming import API_VERSION, MODEL_KIND, SERVER_KIND
from .objects import Body
from .observe import PodFacts, current_template_hash, pod_facts, pod_state
from .oom_kills import OomKill, oom_kills
from .ownership import pool_selector_string
from .placement import PodState
from .scale_to_zero import IdleClock
from .security import TrustCache, server_hostname, tls_secret_name
from .variants import VariantMeter

log = logging.getLogger(__name__)


@dataclass
class PoolContext:
    kube: KubeClient
    control: ModelControlClient
    config: OperatorConfig
    backoff: LoadBackoff
    load_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(16))
    # Seconds a pass's loads may run before the models get a `Loading` status (quicker loads go straight to the
    # final status).
    loading_status_delay: float = 1.0
    trust: TrustCache | None = None  # CAs of pools with spec.tls (None: no pool uses TLS, e.g. in tests)
    # Reads the servers' request counters for models under a canary (None: no traffic figures in status).
    meter: VariantMeter | None = None
    # Reads the LLM engines' queue and KV-cache gauges of pods holding LLM models (None: no status.copies).
    gauges: GaugeReader | None = None
    # The InferenceModels of a pool from the operator's index (None: list them from the API server).
    models: Callable[[str, str], list[Body]] | None = None
    # When each model that may scale to zero last had a request, and which are scaled to zero. Its request
    # counters are read with `meter` (None: no model is ever found idle).
    idle: IdleClock = field(default_factory=IdleClock)
    # Copies leaving pods that stay, waiting for the Service to stop routing there before they are unloaded
    # (None: a copy is unloaded in the pass that removes its label).
    drain: DrainBook | None = None


async def pool_control(ctx: PoolContext, server: Mapping[str, Any]) -> ModelControlClient:
    """The model-control client for one pool: HTTPS verified against its TLS Secret's CA when spec.tls is set."""
    secret = tls_secret_name(server.get("spec") or {})
    if secret is None or ctx.trust is None:
        return ctx.control
    meta = server["metadata"]
    context = await ctx.trust.context(meta["namespace"], secret)
    return ctx.control.with_tls(context, server_hostname(meta["name"], meta["namespace"]))


@dataclass
class PoolModel:
    body: Body
    intent: ModelIntent
    problems: list[str]

    @property
    def deleting(self) -> bool:
        return bool(self.body["metadata"].get("deletionTimestamp"))


def _creation_order(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body["metadata"]
    return meta.get("creationTimestamp") or "", meta["name"]


def _with_kind(body: Body) -> Body:
    # List items of custom resources carry apiVersion/kind, but Events need them, so make sure.
    body.setdefault("apiVersion", API_VERSION)
    body.setdefault("kind", MODEL_KIND)
    return body


def models_of_pool(models: Sequence[Body], pool: str, server: Mapping[str, Any] | None) -> list[PoolModel]:
    """The InferenceModels that want this pool, oldest first, with the problems that keep each from loading.
    Two models of one pool may not share a model name: the younger one is reported, the older one keeps it."""
    found: list[PoolModel] = []
    names: dict[str, str] = {}
    for body in sorted(models, key=_creation_order):
        intent = model_intent(body["metadata"]["name"], body.get("spec") or {})
        if intent.pool != pool:
            continue
        problems = list(intent.problems)
        if server is not None:
            problems += pool_problems(intent, server)
        if intent.model_name in names and not body["metadata"].get("deletionTimestamp"):
            problems.append(
                f"model {intent.model_name!r} is already served on {pool} by InferenceModel {names[intent.model_name]}"
            )
        else:
            names.setdefault(intent.model_name, intent.name)
        found.append(PoolModel(_with_kind(body), intent, problems))
    return found


async def _read_index(control: ModelControlClient, facts: PodFacts) -> list[IndexEntry] | None:
    if not facts.loadable or facts.ip is None:
        return None
    try:
        return await control.index(facts.ip)
    except ControlError as error:
        log.info("pod %s: repository index unavailable: %s", facts.name, error)
        return None


@dataclass(frozen=True)
class PoolSnapshot:
    """What a pass read of its pool before deciding anything: the InferenceServer, its InferenceModels, the pods,
    what each pod's server reports (repository index) and what placement makes of it."""

    namespace: str
    pool: str
    now: str  # the pass's timestamp (conditions, failures)
    server: Body
    control: ModelControlClient  # the pool's model-control client (TLS when spec.tls is set)
    models: tuple[PoolModel, ...]
    facts: tuple[PodFacts, ...]
    index: Mapping[str, list[IndexEntry] | None]  # pod -> repository index (None: unreadable)
    states: Mapping[str, PodState]  # pod -> what placement sees
    deployment: Body | None
    hpa: Body | None
    # pod -> its server container's OOM kill, for pods whose container the OOM killer ended last
    oom_kills: Mapping[str, OomKill] = field(default_factory=dict)

    @property
    def spec(self) -> Mapping[str, Any]:
        return self.server.get("spec") or {}


async def read_pool(
    ctx: PoolContext, namespace: str, pool: str, now: str
) -> tuple[list[PoolModel], PoolSnapshot | None]:
    """Everything a pass reads, read first: the pool's models, and its snapshot (None when the InferenceServer
    does not exist)."""
    kube = ctx.kube
    selector = pool_selector_string(pool)
    # One round trip for everything the API server holds (the pool's children are asked for even before the
    # pool is known to exist: a pass over a missing pool is rare, a round trip on every pass is not).
    reads: list[Awaitable[Any]] = [
        kube.get(API_VERSION, SERVER_KIND, namespace, pool),
        kube.list("v1", "Pod", namespace, selector),
        kube.get("apps/v1", "Deployment", namespace, pool),
        kube.list("apps/v1", "ReplicaSet", namespace, selector),
        kube.get("autoscaling/v2", "HorizontalPodAutoscaler", namespace, pool),
    ]
    if ctx.models is None:
        reads.append(kube.list(API_VERSION, MODEL_KIND, namespace))
    server, pods, deployment, replicasets, hpa, *listed = await asyncio.gather(*reads)
    model_bodies = ctx.models(namespace, pool) if ctx.models is not None else listed[0]
    models = models_of_pool(model_bodies, pool, server)
    if server is None:
        return models, None
    control = await pool_control(ctx, server)
    facts = tuple(pod_facts(p) for p in pods)
    current_hash = current_template_hash(deployment, replicasets)
    indexes = await asyncio.gather(*(_read_index(control, f) for f in facts))
    index = {f.name: idx for f, idx in zip(facts, indexes)}
    intents = [m.intent for m in models]
    states = {f.name: pod_state(f, index[f.name], intents, current_hash) for f in facts}
    return models, PoolSnapshot(
        namespace=namespace,
        pool=pool,
        now=now,
        server=server,
        control=control,
        models=tuple(models),
        facts=facts,
        index=index,
        states=states,
        deployment=deployment,
        hpa=hpa,
        oom_kills=oom_kills(pods),
    )
