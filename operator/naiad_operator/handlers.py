"""kopf handlers, kept thin: render the desired children, apply them with server-side apply, and ask for a
placement pass (which loads models and writes status). Everything is event-driven: watches on the two kinds, on
pool pods and on the children; an index of InferenceModels by pool instead of listing them; one timer per pool
(not per model) for the self-healing pass; and children applied again only when their rendering changes."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Mapping
from functools import partial
from typing import Any

import aiohttp
import kopf

from . import timeline
from .applied import AppliedCache
from .config import OperatorConfig
from .control import ModelControlClient
from .draining import DrainBook
from .events import post as post_event
from .inference_pool import (
    INFERENCE_POOL_API,
    INFERENCE_POOL_KIND,
    INFERENCE_POOL_PLURAL,
    inference_pool_wanted,
    render_inference_pool,
)
from .kube import KubeClient, KubeError
from .leader_worker_set import (
    LWS_API,
    LWS_KIND,
    LWS_MISSING,
    LWS_PLURAL,
    group_network_policy_name,
    render_group_control_secret,
    render_group_network_policy,
    render_leader_worker_set,
)
from .llm_gauges import GaugeReader
from .load_backoff import LoadBackoff
from .model_resources import (
    SHARED_POOL_AUTOSCALING,
    grouped,
    model_autoscaling_ignored,
    model_intent,
    model_labels,
    model_selector,
    promotion_patch,
    render_dedicated_server,
    render_model_hpa,
    render_model_services,
)
from .naming import (
    API_VERSION,
    GROUP,
    MODEL_KIND,
    MODEL_PLURAL,
    SERVER_CONTAINER,
    SERVER_KIND,
    SERVER_LABEL,
    SERVER_PLURAL,
    VERSION,
)
from .objects import Body
from .ownership import Owner
from .placement_pass import PoolReport, reconcile_pool
from .pool_resources import render_pool
from .pool_snapshot import PoolContext
from .pool_wake import HTTP_SCALED_OBJECT_API, HTTP_SCALED_OBJECT_PLURAL, MISSING_API, pool_scales_to_zero
from .runner import PassRunner
from .scale_to_zero import with_load_on_demand
from .security import CONTROL_HEADER, CredentialStore, TrustCache
from .server_spec import server_spec_problems
from .variants import VariantMeter

log = logging.getLogger(__name__)

# _KOPF_PROTOCOLS: kopf types its handler protocols for every resource, so `namespace` is `str | None` (cluster-
# scoped resources) and a handler may not ask for an index by name (startup's `models_by_pool`); Naiad's resources
# are all namespaced. The decorators marked with this name are the operator's only checked-type exceptions there.

# Settings are read once, at import: timer intervals are fixed when the handlers are registered.
_CONFIG = OperatorConfig.from_env()
RESYNC = _CONFIG.resync_seconds
# Retries of a delete before giving up on pods that cannot be reached (their leftovers are unloaded later).
DELETE_RETRIES = 5


# --- lifecycle ------------------------------------------------------------------------------------------------


def connection_info(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """Credentials the same way kopf finds them: the client library's loader, then a service account, then a
    kubeconfig."""
    for login in (kopf.login_via_client, kopf.login_with_service_account, kopf.login_with_kubeconfig):
        info = login(logger=log, settings=settings)
        if info is not None:
            return info
    raise kopf.LoginError("no Kubernetes credentials: neither a service account nor a kubeconfig")


@kopf.index(GROUP, VERSION, MODEL_PLURAL)  # type: ignore[arg-type]  # see _KOPF_PROTOCOLS
def models_by_pool(name: str, namespace: str, spec: kopf.Spec, body: kopf.Body, **_: Any) -> dict[Any, Body]:
    """InferenceModels by (namespace, pool), kept current by the watch: a pass reads its models here instead of
    listing every InferenceModel of the namespace."""
    timeline.mark(namespace, name, "event", str(body.get("metadata", {}).get("resourceVersion")))
    stored = copy.deepcopy(dict(body))
    stored.get("metadata", {}).pop("managedFields", None)  # never read, and most of the object's size
    return {(namespace, model_intent(name, dict(spec)).pool): stored}


def _models_of_pool(index: kopf.Index[Any, Body], namespace: str, pool: str) -> list[Body]:
    """The pool's models, each a copy a pass may change at the top level (it sets `status` after writing it,
    and `apiVersion`/`kind`); what is below is shared with the index and only read (copying all of it cost a
    pass over 100 models about 30 ms of CPU)."""
    return [dict(body) for body in index.get((namespace, pool), [])]


def _recheck_in(report: PoolReport) -> float | None:
    return report.recheck_in


@kopf.on.startup()  # type: ignore[arg-type]  # see _KOPF_PROTOCOLS
async def startup(
    settings: kopf.OperatorSettings, memo: kopf.Memo, models_by_pool: kopf.Index[Any, Body], **_: Any
) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # kopf's own Normal events ("Handler 'model_changed' succeeded", "Creation is processed") cost two API writes
    # per change and say nothing the operator's own events (Loaded, Unloaded, ...) do not; warnings and errors
    # (a handler that failed) are still posted.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.batching.error_delays = (1, 2, 5, 10, 20, 30, 60)

    config = _CONFIG
    memo.config = config
    memo.kube = KubeClient(lambda: asyncio.to_thread(connection_info, settings))
    memo.http = aiohttp.ClientSession()
    memo.credentials = CredentialStore(memo.kube, config.operator_namespace)
    await memo.credentials.refresh()  # fails the start (and kopf retries it) when the Secret cannot be had
    control = ModelControlClient(
        memo.http,
        request_timeout=config.request_timeout_seconds,
        load_timeout=config.load_timeout_seconds,
        credentials=memo.credentials.to_try,
        credential_header=CONTROL_HEADER,
    )
    memo.backoff = LoadBackoff(config.load_retry_seconds)
    context = PoolContext(
        kube=memo.kube,
        control=control,
        config=config,
        backoff=memo.backoff,
        trust=TrustCache(memo.kube),
        meter=VariantMeter(memo.http, config.request_timeout_seconds),
        gauges=GaugeReader(memo.http, config.request_timeout_seconds),
        models=partial(_models_of_pool, models_by_pool),
        drain=DrainBook(config.unload_delay_seconds),
    )
    memo.pools = PassRunner(partial(reconcile_pool, context), again=_recheck_in)
    memo.pool_models = partial(_models_of_pool, models_by_pool)
    memo.pod_fingerprints = {}
    memo.applied = AppliedCache()
    log.info(
        "naiad-operator started: server image %s, resync every %.0fs",
        config.server_image,
        config.resync_seconds,
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await memo.pools.close()
    await memo.http.close()
    await memo.kube.close()


# --- shared helpers -------------------------------------------------------------------------------------------


def _retry_or_raise(error: KubeError, what: str) -> kopf.TemporaryError | kopf.PermanentError:
    if error.retriable:
        return kopf.TemporaryError(f"{what}: {error}", delay=10)
    return kopf.PermanentError(f"{what}: {error}")


async def _gather_all(*aws: Any) -> list[Any]:
    """Await all of `aws` together and only then raise the first failure, so that none is left running unowned."""
    outcomes = await asyncio.gather(*aws, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


async def _apply_all(
    kube: KubeClient, objects: list[Body], cache: AppliedCache | None = None, *, concurrent: bool = False
) -> list[str]:
    """Apply each object that changed since it was last applied; an object the API rejects does not stop the
    others. Passing failures raise. `concurrent`: all at once, for objects that do not need each other to exist
    first (a model's Services); a pool's children go in order (its Secret and claim before its Deployment)."""

    async def one(obj: Body) -> str | None:
        what = f"{obj['kind']} {obj['metadata']['name']}"
        try:
            await kube.apply(obj)
        except KubeError as error:
            if error.retriable:
                raise kopf.TemporaryError(f"applying {what}: {error}", delay=10) from error
            return f"{what}: {error.message}"
        if cache is not None:
            cache.applied(obj)
        return None

    wanted = [obj for obj in objects if cache is None or not cache.unchanged(obj)]
    if concurrent:
        return [o for o in await _gather_all(*(one(obj) for obj in wanted)) if o is not None]
    rejected = []
    for obj in wanted:
        problem = await one(obj)
        if problem is not None:
            rejected.append(problem)
    return rejected


async def _delete_if_owned(
    kube: KubeClient,
    api_version: str,
    kind: str,
    namespace: str,
    name: str,
    owner_uid: str,
    cache: AppliedCache | None = None,
) -> None:
    """Remove a child that is no longer wanted, never an object someone else made with the same name."""
    key = (api_version, kind, namespace, name)
    if cache is not None and cache.known_absent(key):
        return
    try:
        existing = await kube.get(api_version, kind, namespace, name)
    except KubeError as error:
        if error.status == 404:  # the API itself is not served (e.g. no monitoring.coreos.com)
            return
        raise
    if existing is not None:
        owners = existing["metadata"].get("ownerReferences") or []
        if not any(ref.get("uid") == owner_uid for ref in owners):
            return  # someone else's: leave it, and look again next time
        await kube.delete(api_version, kind, namespace, name)
    if cache is not None:
        cache.absent(key)


def _report(body: Body, problems: list[str], reason: str, events: bool) -> None:
    if problems and events:
        post_event(body, "Warning", reason, "; ".join(problems))


# --- InferenceServer ------------------------------------------------------------------------------------------


async def ensure_pool(memo: kopf.Memo, body: Body, *, events: bool) -> list[str]:
    """Apply the Deployment, Services, claim, HPA and ServiceMonitor of a pool; returns spec problems."""
    owner = Owner.of(body)
    spec = body.get("spec") or {}
    problems = server_spec_problems(owner.name, spec)
    if problems:
        _report(body, problems, "InvalidSpec", events)
        return problems
    config: OperatorConfig = memo.config
    kube: KubeClient = memo.kube
    monitoring = config.service_monitors != "false" and await kube.api_available(
        "monitoring.coreos.com/v1", "servicemonitors"
    )
    wake_api = await kube.api_available(HTTP_SCALED_OBJECT_API, HTTP_SCALED_OBJECT_PLURAL)
    credentials = await memo.credentials.refresh()  # also carries out a rotation asked for on the Secret
    pool_models = getattr(memo, "pool_models", None)
    models = pool_models(owner.namespace, owner.name) if pool_models is not None else []
    spec = with_load_on_demand(spec, models)  # when the pool or one of its models may scale to zero
    objects = render_pool(owner, spec, config, monitoring, credentials.current, wake_api)
    cache = getattr(memo, "applied", None)
    rejected = await _apply_all(kube, objects.apply, cache)
    if pool_scales_to_zero(spec) and not wake_api:
        _report(body, [MISSING_API], "ScaleToZeroUnavailable", events)
    for api_version, kind, name in objects.absent:
        await _delete_if_owned(kube, api_version, kind, owner.namespace, name, owner.uid, cache)
    _report(body, rejected, "ApplyFailed", events)
    return rejected


@kopf.on.resume(GROUP, VERSION, SERVER_PLURAL)
@kopf.on.create(GROUP, VERSION, SERVER_PLURAL)
@kopf.on.update(GROUP, VERSION, SERVER_PLURAL)  # type: ignore[arg-type]  # see _KOPF_PROTOCOLS
async def server_changed(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    try:
        await ensure_pool(memo, dict(body), events=True)
    except KubeError as error:
        raise _retry_or_raise(error, f"InferenceServer {name}") from error
    memo.pools.request(namespace, name)


# sharp: a pass every RESYNC seconds, not RESYNC after the previous one ended: the period does not stretch with the
# pass's duration, so a window that is a multiple of it always holds the same number of passes (with 15.2 s periods a
# 2-minute window held 7 or 8, +-9 % of the operator's steady-state requests).
@kopf.timer(GROUP, VERSION, SERVER_PLURAL, interval=RESYNC, initial_delay=RESYNC / 3, sharp=True)  # type: ignore[arg-type]  # see _KOPF_PROTOCOLS
async def server_resync(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Self-healing: re-apply the children and compare every pod's repository index with the placements."""
    try:
        await ensure_pool(memo, dict(body), events=False)
        await memo.pools.run(namespace, name)
    except KubeError as error:
        raise _retry_or_raise(error, f"resync of InferenceServer {name}") from error


# --- InferenceModel -------------------------------------------------------------------------------------------


async def ensure_model(memo: kopf.Memo, body: Body, *, events: bool) -> str:
    """Apply the dedicated pool (without serverRef), the model's Services and HPA; returns the pool name."""
    owner = Owner.of(body)
    spec = body.get("spec") or {}
    intent = model_intent(owner.name, spec)
    if intent.problems:
        _report(body, intent.problems, "InvalidSpec", events)
        return intent.pool
    config: OperatorConfig = memo.config
    kube: KubeClient = memo.kube
    objects: list[Body] = []
    group = grouped(intent)
    group_api = group and await kube.api_available(LWS_API, LWS_PLURAL)
    if group and not group_api:
        _report(body, [LWS_MISSING], "LeaderWorkerSetMissing", events)
        return intent.pool
    if group:
        credential = (await memo.credentials.refresh()).current
        objects.append(render_group_control_secret(owner, intent, credential))  # before the pods that read it
        objects.append(render_leader_worker_set(owner, spec, intent, config, credential))
        objects.append(render_group_network_policy(owner, intent))
    elif intent.dedicated:
        existing = await kube.get(API_VERSION, SERVER_KIND, owner.namespace, intent.pool)
        if existing is None or any(
            r.get("uid") == owner.uid for r in existing["metadata"].get("ownerReferences") or []
        ):
            objects.append(render_dedicated_server(owner, spec, intent))
        # else: someone else's InferenceServer has the name; the pass reports it in status.
    objects += render_model_services(owner, intent)
    if model_autoscaling_ignored(spec, intent) and events:
        post_event(body, "Warning", "AutoscalingIgnored", SHARED_POOL_AUTOSCALING)
    hpa = render_model_hpa(owner, spec, intent, config)
    if hpa is not None:
        objects.append(hpa)
    # Asked for every model (discovery is cached): a model that stops being an LLM loses its InferencePool.
    pool_api = config.inference_pools != "false" and await kube.api_available(
        INFERENCE_POOL_API, INFERENCE_POOL_PLURAL
    )
    inference_pool = inference_pool_wanted(intent.llm, pool_api, config.inference_pools)
    if inference_pool and intent.llm is not None:
        objects.append(render_inference_pool(owner, intent.llm, model_selector(intent), model_labels(intent)))
    cache = getattr(memo, "applied", None)

    # One round trip, not one per child: the Services (and the check for a leftover HPA) at once.
    async def leftover_hpa() -> None:
        if hpa is None:
            await _delete_if_owned(
                kube,
                "autoscaling/v2",
                "HorizontalPodAutoscaler",
                owner.namespace,
                owner.name,
                owner.uid,
                cache,
            )
        # a model that became larger than a node leaves its pool behind, one that fits again its group
        if group:
            await _delete_if_owned(
                kube, API_VERSION, SERVER_KIND, owner.namespace, intent.pool, owner.uid, cache
            )
        elif intent.llm is not None and await kube.api_available(LWS_API, LWS_PLURAL):
            await _delete_if_owned(kube, LWS_API, LWS_KIND, owner.namespace, intent.pool, owner.uid, cache)
            await _delete_if_owned(
                kube,
                "networking.k8s.io/v1",
                "NetworkPolicy",
                owner.namespace,
                group_network_policy_name(intent),
                owner.uid,
                cache,
            )
        if pool_api and not inference_pool:  # not an LLM (any more), or llm.inferencePool.enabled is false
            await _delete_if_owned(
                kube, INFERENCE_POOL_API, INFERENCE_POOL_KIND, owner.namespace, owner.name, owner.uid, cache
            )

    rejected, _ = await _gather_all(_apply_all(kube, objects, cache, concurrent=True), leftover_hpa())
    _report(body, rejected, "ApplyFailed", events)
    return intent.pool


@kopf.on.resume(GROUP, VERSION, MODEL_PLURAL)
@kopf.on.create(GROUP, VERSION, MODEL_PLURAL)
@kopf.on.update(GROUP, VERSION, MODEL_PLURAL)  # type: ignore[arg-type]  # see _KOPF_PROTOCOLS
async def model_changed(
    body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, old: Mapping[str, Any] | None, **_: Any
) -> None:
    timeline.mark(namespace, name, "handler")
    if ((body.get("spec") or {}).get("canary") or {}).get("promote"):
        await promote(memo, dict(body))
    intent = model_intent(name, dict(body.get("spec") or {}))
    pool = intent.pool
    if not intent.dedicated:
        # A shared pool's pass reads the model from the index and needs none of its children: it loads now,
        # while the Services are applied (a Service the API refuses never kept a model from loading either).
        timeline.mark(namespace, name, "requested", pool)
        memo.pools.request(namespace, pool)
    try:
        await ensure_model(memo, dict(body), events=True)
    except KubeError as error:
        raise _retry_or_raise(error, f"InferenceModel {name}") from error
    timeline.mark(namespace, name, "children")
    if intent.dedicated:  # its pool exists from here on
        timeline.mark(namespace, name, "requested", pool)
        memo.pools.request(namespace, pool)
    previous = model_intent(name, (old or {}).get("spec") or {}).pool if old else pool
    if previous != pool:
        memo.pools.request(namespace, previous)  # the old pool unloads it (its records are now strays)
    was_zero = old is not None and ((old.get("spec") or {}).get("minReplicas") == 0)
    if intent.scales_to_zero != was_zero and not intent.dedicated:
        await _ensure_pool_named(memo, namespace, pool)  # its servers start (or stop) loading on demand


async def _ensure_pool_named(memo: kopf.Memo, namespace: str, pool: str) -> None:
    try:
        server = await memo.kube.get(API_VERSION, SERVER_KIND, namespace, pool)
        if server is not None:
            await ensure_pool(memo, server, events=False)
    except KubeError as error:
        raise _retry_or_raise(error, f"InferenceServer {pool}") from error


def _is_grouped(spec: kopf.Spec, name: str, **_: Any) -> bool:
    return grouped(model_intent(name, dict(spec or {})))


# A grouped model has no pool (no pool timer, no pool pods to watch): its status follows its LeaderWorkerSet's.
@kopf.timer(GROUP, VERSION, MODEL_PLURAL, interval=RESYNC / 3, initial_delay=RESYNC / 3, when=_is_grouped)  # type: ignore[arg-type]  # see _KOPF_PROTOCOLS
async def group_resync(spec: kopf.Spec, name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    memo.pools.request(namespace, model_intent(name, dict(spec or {})).pool)


async def promote(memo: kopf.Memo, body: Body) -> None:
    """canary.promote: the canary's version and config become the model's and `canary` goes; the update that
    follows reloads the stable pods with what the canary pods already hold (they keep it)."""
    meta = body["metadata"]
    try:
        await memo.kube.patch(
            API_VERSION,
            MODEL_KIND,
            meta["namespace"],
            meta["name"],
            promotion_patch(body.get("spec") or {}),
            patch_type="json",
        )
    except KubeError as error:
        raise _retry_or_raise(error, f"promoting the canary of InferenceModel {meta['name']}") from error
    post_event(body, "Normal", "CanaryPromoted", "the canary's version and config are now the model's")


@kopf.on.delete(GROUP, VERSION, MODEL_PLURAL)  # type: ignore[arg-type]  # see _KOPF_PROTOCOLS
async def model_deleted(
    body: kopf.Body, spec: kopf.Spec, name: str, namespace: str, memo: kopf.Memo, retry: int, **_: Any
) -> None:
    """Unload from every pod of a shared pool and drop the labels (the pass sees the deletionTimestamp). A
    dedicated pool is removed with the model by garbage collection, so there is nothing to unload."""
    intent = model_intent(name, dict(spec))
    memo.backoff.forget_model(namespace, name)
    if intent.dedicated:
        return
    try:
        report: PoolReport = await memo.pools.run(namespace, intent.pool)
    except KubeError as error:
        raise _retry_or_raise(error, f"unloading InferenceModel {name}") from error
    left = report.holders.get(name, [])
    if left and retry < DELETE_RETRIES:
        # Copies waiting for the Service to drop their pods are unloaded within seconds (draining.py).
        draining = set(left) <= set(report.draining.get(name, []))
        raise kopf.TemporaryError(
            f"{intent.model_name} is still loaded on {', '.join(sorted(left))}", delay=2 if draining else 10
        )
    if left:
        post_event(
            dict(body),
            "Warning",
            "UnloadIncomplete",
            f"gave up unloading from {', '.join(sorted(left))}; the pool unloads it when they answer",
        )


# --- pods -----------------------------------------------------------------------------------------------------


def pod_fingerprint(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """The parts of a pod that change what placement sees (not the labels and annotations the pass writes)."""
    status = body.get("status") or {}
    container: Mapping[str, Any] = next(
        (c for c in status.get("containerStatuses") or [] if c.get("name") == SERVER_CONTAINER), {}
    )
    meta = body.get("metadata") or {}
    return (
        status.get("podIP"),
        bool(container.get("ready")),
        container.get("restartCount"),
        bool(meta.get("deletionTimestamp")),
    )


@kopf.on.event("", "v1", "pods", labels={SERVER_LABEL: kopf.PRESENT})  # type: ignore[arg-type]  # see _KOPF_PROTOCOLS
async def pod_event(
    event: Mapping[str, Any], body: kopf.Body, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    """A pod of a pool started, became ready, restarted or went away: give the pool a pass right now, so new
    replicas get their models before they count as serving."""
    uid = body["metadata"].get("uid")
    if event.get("type") == "DELETED":
        memo.pod_fingerprints.pop(uid, None)
    else:
        fingerprint = pod_fingerprint(body)
        if memo.pod_fingerprints.get(uid) == fingerprint:
            return
        memo.pod_fingerprints[uid] = fingerprint
    memo.pools.request(namespace, body["metadata"]["labels"][SERVER_LABEL])


# --- children -------------------------------------------------------------------------------------------------


@kopf.on.event("", "v1", "services", labels={SERVER_LABEL: kopf.PRESENT})
@kopf.on.event("apps", "v1", "deployments", labels={SERVER_LABEL: kopf.PRESENT})
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels={SERVER_LABEL: kopf.PRESENT})  # type: ignore[arg-type]  # see _KOPF_PROTOCOLS
async def child_event(
    event: Mapping[str, Any], body: kopf.Body, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    """A child deleted (by hand, or by anything but its owner's deletion): apply it again now, instead of
    re-applying every child on a timer to find out."""
    if event.get("type") != "DELETED":
        return
    meta = body["metadata"]
    memo.applied.forget((body.get("apiVersion", ""), body.get("kind", ""), namespace, meta["name"]))
    for ref in meta.get("ownerReferences") or []:
        if ref.get("apiVersion") != API_VERSION:
            continue
        try:
            owner = await memo.kube.get(API_VERSION, ref["kind"], namespace, ref["name"])
            if (
                owner is None
                or owner["metadata"].get("deletionTimestamp")
                or owner["metadata"]["uid"] != ref["uid"]
            ):
                continue  # the owner is going too: garbage collection, not drift
            if ref["kind"] == SERVER_KIND:
                await ensure_pool(memo, owner, events=False)
            elif ref["kind"] == MODEL_KIND:
                await ensure_model(memo, owner, events=False)
        except KubeError as error:
            raise _retry_or_raise(error, f"restoring {meta['name']}") from error
