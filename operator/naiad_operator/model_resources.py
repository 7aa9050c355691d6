"""Pure renderers for an InferenceModel: what to load (name, config, revision), on which pool, and the objects
around it (a dedicated InferenceServer, the model's Services, its HPA)."""

from __future__ import annotations

import copy
import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import lora_adapters
from .config import OperatorConfig
from .llm import (
    LLMSpec,
    apply_to_dedicated_server,
    dedicated_gpu_problems,
    llm_spec,
    openai_service_port,
    openai_url,
    shared_gpu_problems,
    token_metrics,
)
from .metrics_resources import render_hpa
from .naming import (
    API_VERSION,
    DEDICATED_FOR_LABEL,
    GRPC_PORT,
    HTTP_PORT,
    MAX_MODEL_NAME,
    MODEL_KIND,
    MODEL_LABEL_VALUE,
    SERVER_KIND,
    SERVER_LABEL,
    SERVICE_ROLE_LABEL,
    dedicated_server_name,
    headless_service_name,
    leader_selector,
    model_label_key,
    name_problems,
    selector_string,
    short_hash,
)
from .objects import Body, Spec
from .ownership import Owner
from .quantity import quantity_bytes
from .scale_to_zero import DEFAULT_IDLE_SECONDS
from .server_spec import (
    autoscaling_active,
    desired_replicas,
    repository_claim,
    repository_path,
    repository_secret,
    repository_uri,
    server_spec_problems,
)
from .vllm_parallelism import vllm_load_config

# Fields of a dedicated pool that the InferenceModel decides (its replicas drive the pool; its HPA scales it).
_MODEL_OWNED_SERVER_FIELDS = ("replicas", "minReplicas", "maxReplicas", "autoscaling")


@dataclass(frozen=True)
class Repository:
    """Where a model's repository lives: a claim (and directory in it), a directory already in the image, or an
    object store (s3://..., https://...archive) read with the credentials of a Secret or of the pod."""

    claim: str | None
    sub_path: str  # "" for the volume root
    path: str | None = None  # file:// repositories: the directory in the container
    uri: str | None = None  # s3:// and https:// repositories, as the server reads them
    secret: str | None = None  # the Secret holding AWS_* keys for `uri` (None: the pod's own identity)


@dataclass(frozen=True)
class CanaryIntent:
    """The canary variant of a model: another version and/or config on `percent` of its pods."""

    revision: str
    load_config: dict[str, Any] | None
    version: str | None
    percent: int
    promote: bool


@dataclass(frozen=True)
class ModelIntent:
    """Everything the placement loop needs to know about one InferenceModel."""

    name: str
    model_name: str
    pool: str
    dedicated: bool
    revision: str
    load_config: dict[str, Any] | None
    version: str | None
    replicas: int | None  # None: every pod of the pool (a dedicated pool is sized by the model)
    memory: int
    backend: str | None
    suspended: bool
    repository: Repository | None
    problems: list[str] = field(default_factory=list)
    canary: CanaryIntent | None = None
    llm: LLMSpec | None = None  # an LLM model (spec.llm)
    # minReplicas: 0 (a shared pool): no copies after idle_seconds without a request (scale_to_zero.py).
    scales_to_zero: bool = False
    idle_seconds: int = DEFAULT_IDLE_SECONDS

    @property
    def wanted_replicas(self) -> int | None:
        return 0 if self.suspended else self.replicas

    def variant(self, revision: str) -> tuple[str, dict[str, Any] | None, str | None]:
        """(variant name, load config, version) of a revision this model wants on some pod."""
        if self.canary is not None and revision == self.canary.revision:
            return "canary", self.canary.load_config, self.canary.version
        return "stable", self.load_config, self.version

    @property
    def revisions(self) -> tuple[str, ...]:
        return (self.revision,) if self.canary is None else (self.revision, self.canary.revision)


def _normal_dir(path: str | None) -> str:
    if not path:
        return ""
    normal = posixpath.normpath(path.strip("/"))
    return "" if normal == "." else normal


def parse_storage_uri(uri: str, secret: str | None = None) -> Repository:
    """pvc://claim[/dir], file:///dir, s3://[host:port/]bucket[/dir] or https://.../<model>.tar.gz|.zip; raises
    ValueError otherwise."""
    if uri.startswith("s3://"):
        if not uri[len("s3://") :].strip("/"):
            raise ValueError(
                f"storage.uri {_redacted(uri)!r} names no bucket (expected s3://<bucket>[/<dir>])"
            )
        return Repository(claim=None, sub_path="", uri=uri.rstrip("/"), secret=secret)
    if uri.startswith("https://"):
        if not uri.split("#", 1)[0].endswith((".tar.gz", ".tgz", ".tar", ".zip")):
            raise ValueError(
                f"storage.uri {_redacted(uri)!r}: an https:// model is a .tar.gz, .tgz, .tar or .zip archive"
            )
        return Repository(claim=None, sub_path="", uri=uri, secret=secret)
    if secret:
        raise ValueError(
            "storage.secretRef holds object-store credentials: it needs an s3:// or https:// uri"
        )
    if uri.startswith("pvc://"):
        rest = uri[len("pvc://") :]
        claim, _, sub_path = rest.partition("/")
        if not claim:
            raise ValueError(f"storage.uri {uri!r} names no claim (expected pvc://<claim>[/<dir>])")
        return Repository(claim=claim, sub_path=_normal_dir(sub_path))
    if uri.startswith("file:///"):
        return Repository(claim=None, sub_path="", path="/" + _normal_dir(uri[len("file://") :]))
    raise ValueError(f"storage.uri {_redacted(uri)!r} must start with pvc://, file:///, s3:// or https://")


def _redacted(uri: str) -> str:
    """A URI fit for status and events: user:password@ in an https:// URI is dropped."""
    scheme, sep, rest = uri.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme}{sep}{host.rpartition('@')[2]}{slash}{path}"


def model_name_of(name: str, spec: Spec) -> str:
    if spec.get("modelName"):
        return str(spec["modelName"])
    if spec.get("path"):
        return posixpath.basename(_normal_dir(spec["path"]))
    return name


def load_config(spec: Spec) -> dict[str, Any] | None:
    """The ModelConfig override sent with the load call: `config`, with `version` as a specific version policy."""
    config = copy.deepcopy(dict(spec["config"])) if spec.get("config") else None
    if spec.get("version") is not None:
        config = config or {}
        config["version_policy"] = {"specific": {"versions": [int(spec["version"])]}}
    return config


def llm_load_config(
    llm: LLMSpec | None, config: Mapping[str, Any] | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """(the load config, problems): `config` with what the `llm` block adds (vLLM's parallel sizes, the LoRA
    adapters); unchanged for a model that is not an LLM."""
    config, problems = vllm_load_config(llm, config)
    if llm is not None:
        config, more = lora_adapters.with_adapters(llm.lora_adapters, config)
        problems += more
    return config, problems


def revision_of(model_name: str, config: Mapping[str, Any] | None) -> str:
    """Identifies what a pod should hold: a change of name, version or config is a new revision (a live reload)."""
    return short_hash(
        json.dumps({"model": model_name, "config": config}, sort_keys=True, separators=(",", ":"))
    )


def canary_spec(spec: Spec) -> dict[str, Any]:
    """The model spec as the canary variant sees it: the canary's version and config replace the model's."""
    canary = spec.get("canary") or {}
    merged = dict(spec)
    for key in ("version", "config"):
        if key in canary:
            merged[key] = canary[key]
    return merged


def promotion_patch(spec: Spec) -> list[dict[str, Any]]:
    """JSON patch that promotes a canary: its version and config become the model's, `canary` goes."""
    canary = spec.get("canary") or {}
    ops: list[dict[str, Any]] = [{"op": "remove", "path": "/spec/canary"}]
    for key in ("version", "config"):
        if key in canary:
            ops.append({"op": "add", "path": f"/spec/{key}", "value": copy.deepcopy(canary[key])})
    return ops


def _canary_intent(
    model_name: str, spec: Spec, stable_revision: str, problems: list[str], llm: LLMSpec | None = None
) -> CanaryIntent | None:
    canary = spec.get("canary")
    if not canary:
        return None
    percent = canary.get("trafficPercent")
    if not isinstance(percent, int) or isinstance(percent, bool) or not 0 <= percent <= 100:
        problems.append(f"canary.trafficPercent must be an integer from 0 to 100, got {percent!r}")
        return None
    if "version" not in canary and "config" not in canary:
        problems.append("canary needs a version or a config that differs from the model's")
        return None
    merged = canary_spec(spec)
    config, config_problems = llm_load_config(llm, load_config(merged))
    problems += [f"canary: {problem}" for problem in config_problems]
    revision = revision_of(model_name, config)
    if revision == stable_revision:
        return None  # the canary is what already runs: nothing to split
    return CanaryIntent(
        revision=revision,
        load_config=config,
        version=str(merged["version"]) if merged.get("version") is not None else None,
        percent=percent,
        promote=bool(canary.get("promote", False)),
    )


def model_intent(name: str, spec: Spec) -> ModelIntent:
    problems = name_problems(name, MAX_MODEL_NAME)
    model_name = model_name_of(name, spec)
    repository: Repository | None = None
    if spec.get("storage"):
        try:
            storage = spec["storage"]
            secret = (storage.get("secretRef") or {}).get("name") or None
            repository = parse_storage_uri(str(storage["uri"]), secret)
        except ValueError as error:
            problems.append(str(error))
    elif spec.get("path"):
        path = _normal_dir(spec["path"])
        if posixpath.basename(path) != model_name:
            problems.append(
                f"path {spec['path']!r} ends in {posixpath.basename(path)!r} but modelName is {model_name!r}: the "
                "server finds a model by its directory name"
            )
        repository = Repository(claim=None, sub_path=posixpath.dirname(path))
    if spec.get("serverRef") and spec.get("server") is not None:
        problems.append("set either serverRef or server, not both")
    dedicated = not spec.get("serverRef")
    pool = dedicated_server_name(name) if dedicated else str(spec["serverRef"]["name"])
    memory = 0
    try:
        memory = quantity_bytes(spec.get("memory"))
    except ValueError as error:
        problems.append(f"memory: {error}")
    llm = llm_spec(name, spec)
    config, config_problems = llm_load_config(llm, load_config(spec))
    if llm is not None:
        problems += llm.problems + config_problems
        if dedicated:
            problems += dedicated_gpu_problems(llm, spec.get("server") or {})
    if dedicated:
        problems += _dedicated_problems(spec, repository)
    revision = revision_of(model_name, config)
    canary = _canary_intent(model_name, spec, revision, problems, llm)
    scales_to_zero = spec.get("minReplicas") == 0
    if scales_to_zero:
        problems += _scale_to_zero_problems(spec, dedicated, canary)
    return ModelIntent(
        scales_to_zero=scales_to_zero and not problems,
        idle_seconds=int(spec.get("idleSeconds") or DEFAULT_IDLE_SECONDS),
        canary=canary,
        name=name,
        model_name=model_name,
        pool=pool,
        dedicated=dedicated,
        revision=revision,
        load_config=config,
        version=str(spec["version"]) if spec.get("version") is not None else None,
        replicas=None if dedicated else desired_replicas(spec),
        memory=memory,
        backend=spec.get("backend") or (llm.backend if llm is not None else None),
        suspended=bool(spec.get("suspended", False)),
        repository=repository,
        problems=problems,
        llm=llm,
    )


def _scale_to_zero_problems(spec: Spec, dedicated: bool, canary: CanaryIntent | None) -> list[str]:
    """minReplicas: 0 gives up the model's copies on a pool whose pods stay: a pool of its own scaled to zero
    pods (KEDA's HTTP add-on) is not done, and a canary's two variants cannot both be loaded on demand."""
    problems = []
    if dedicated:
        problems.append(
            "minReplicas: 0 needs serverRef: a model gives up its copies on a shared pool whose pods stay (a "
            "dedicated pool scaled to zero pods is not supported)"
        )
    if canary is not None:
        problems.append("minReplicas: 0 and a canary cannot be combined: a load on demand has no variant")
    return problems


def _dedicated_problems(spec: Spec, repo: Repository | None) -> list[str]:
    """A dedicated pool needs somewhere to read the model from when `path` names a directory in a volume."""
    template = (spec.get("server") or {}).get("modelRepository") or {}
    has_volume = bool(template.get("claimName") or template.get("create"))
    if repo is not None and repo.claim is None and repo.path is None and repo.uri is None and not has_volume:
        return ["path needs a volume: set storage.uri to pvc://<claim>/... or server.modelRepository"]
    return []


def pool_problems(intent: ModelIntent, pool: Mapping[str, Any]) -> list[str]:
    """Why this pool cannot serve the model: a dedicated pool that was not made for it, a backend it cannot run,
    or another repository."""
    problems = []
    pool_spec = pool.get("spec") or {}
    if intent.dedicated:
        made_for = ((pool.get("metadata") or {}).get("labels") or {}).get(DEDICATED_FOR_LABEL)
        if made_for != intent.name:
            problems.append(
                f"InferenceServer {intent.pool} exists and was not created for this model; set serverRef to use it"
            )
        else:
            # The template is the model's spec: its mistakes are the model's to report.
            problems += [f"server: {p}" for p in server_spec_problems(intent.pool, pool_spec)]
    if intent.llm is not None and not intent.dedicated:
        problems += shared_gpu_problems(intent.llm, intent.pool, pool_spec)
    backends = (pool_spec.get("capabilities") or {}).get("backends") or []
    if intent.backend and backends and intent.backend not in backends:
        problems.append(
            f"InferenceServer {intent.pool} runs backends {sorted(backends)}, not {intent.backend!r}"
        )
    repo = intent.repository
    if repo is not None and not intent.dedicated:
        pool_claim = repository_claim(intent.pool, pool_spec)
        pool_sub = _normal_dir((pool_spec.get("modelRepository") or {}).get("subPath"))
        if repo.uri is not None:
            if repository_uri(pool_spec) != repo.uri:
                problems.append(
                    f"InferenceServer {intent.pool} does not serve the repository {_redacted(repo.uri)} "
                    "(set its modelRepository.uri to it, or use a dedicated pool)"
                )
            elif repo.secret and repository_secret(pool_spec) != repo.secret:
                problems.append(
                    f"the model reads {_redacted(repo.uri)} with Secret {repo.secret!r} but InferenceServer "
                    f"{intent.pool} uses {repository_secret(pool_spec) or 'the identity of its pods'}"
                )
        elif repo.path is not None:
            if pool_claim is not None or repository_path(pool_spec) != repo.path:
                problems.append(
                    f"InferenceServer {intent.pool} does not serve the repository {repo.path} from its image"
                )
        else:
            if repo.claim is not None and repo.claim != pool_claim:
                problems.append(
                    f"the model is on claim {repo.claim!r} but InferenceServer {intent.pool} mounts "
                    f"{pool_claim!r}"
                )
            if repo.sub_path != pool_sub:
                problems.append(
                    f"the model's repository directory is {repo.sub_path or '/'!r} but InferenceServer "
                    f"{intent.pool} serves {pool_sub or '/'!r}"
                )
    return problems


# --- dedicated pool ---------------------------------------------------------------------------------------------


def render_dedicated_server(owner: Owner, spec: Spec, intent: ModelIntent) -> Body:
    """The InferenceServer an InferenceModel without serverRef runs on: the `server` template, with the
    repository from storage/path and the size from the model (suspended: zero pods)."""
    server_spec = {
        k: copy.deepcopy(v)
        for k, v in (spec.get("server") or {}).items()
        if k not in _MODEL_OWNED_SERVER_FIELDS
    }
    server_spec["replicas"] = 0 if intent.suspended else desired_replicas(spec)
    server_spec["autoscaling"] = {"enabled": False}
    repo = intent.repository
    if repo is not None:
        repository = dict(server_spec.get("modelRepository") or {})
        if repo.uri is not None:
            repository = {"uri": repo.uri}
            if repo.secret:
                repository["secretRef"] = {"name": repo.secret}
        elif repo.path is not None:
            repository = {"path": repo.path}
        else:
            if repo.claim is not None:
                repository.pop("create", None)
                repository["claimName"] = repo.claim
            if repo.sub_path:
                repository["subPath"] = repo.sub_path
            else:
                repository.pop("subPath", None)
        server_spec["modelRepository"] = repository
    if intent.llm is not None:
        server_spec = apply_to_dedicated_server(intent.llm, server_spec)
    return {
        "apiVersion": API_VERSION,
        "kind": SERVER_KIND,
        "metadata": {
            "name": intent.pool,
            "namespace": owner.namespace,
            "labels": {DEDICATED_FOR_LABEL: owner.name, "app.kubernetes.io/managed-by": "naiad-operator"},
            "ownerReferences": [owner.reference()],
        },
        "spec": server_spec,
    }


# --- model Services and HPA -------------------------------------------------------------------------------------


def grouped(intent: ModelIntent) -> bool:
    """A copy larger than a node: the model runs as a LeaderWorkerSet (leader_worker_set.py), not on a pool."""
    return intent.dedicated and intent.llm is not None and intent.llm.group_size > 1


def model_selector(intent: ModelIntent) -> dict[str, str]:
    """Pods of the pool that hold the model (a grouped model: its groups' leaders): what the model's Services and
    its HPA select."""
    if grouped(intent):
        return leader_selector(intent.pool)
    return {SERVER_LABEL: intent.pool, model_label_key(intent.name): MODEL_LABEL_VALUE}


def model_selector_string(intent: ModelIntent) -> str:
    return selector_string(model_selector(intent))


def model_labels(intent: ModelIntent) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "naiad-model",
        "app.kubernetes.io/instance": intent.name,
        "app.kubernetes.io/managed-by": "naiad-operator",
        SERVER_LABEL: intent.pool,
    }


def _ports(llm: bool = False) -> list[Body]:
    ports = [
        {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
        {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
    ]
    if llm:
        ports.append(openai_service_port())
    return ports


def render_model_services(owner: Owner, intent: ModelIntent) -> list[Body]:
    """A Service named after the model that reaches only pods holding it, and a headless twin for gRPC clients
    that balance per pod."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": intent.name,
            "namespace": owner.namespace,
            "labels": {**model_labels(intent), SERVICE_ROLE_LABEL: "model"},
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": model_selector(intent),
            "ports": _ports(intent.llm is not None),
        },
    }
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": headless_service_name(intent.name),
            "namespace": owner.namespace,
            "labels": {**model_labels(intent), SERVICE_ROLE_LABEL: "model-headless"},
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "clusterIP": "None",
            "selector": model_selector(intent),
            "ports": _ports(),
            "publishNotReadyAddresses": False,
        },
    }
    return [service, headless]


SHARED_POOL_AUTOSCALING = (
    "autoscaling is ignored for a model on a shared pool: Kubernetes refuses to run two autoscalers over the "
    "same pods (AmbiguousSelector), and a pool's pods are shared by its models and its own autoscaler. "
    "Autoscale the InferenceServer instead, or give the model a dedicated pool (no serverRef)"
)


def model_autoscaling_ignored(spec: Spec, intent: ModelIntent) -> bool:
    return not intent.dedicated and autoscaling_active(spec)


def render_model_hpa(owner: Owner, spec: Spec, intent: ModelIntent, config: OperatorConfig) -> Body | None:
    """HPA on the InferenceModel's scale subresource, for a model with a dedicated pool (whose pods only this
    HPA selects); its default metric is the queue time of this model only."""
    if intent.suspended or not intent.dedicated or not autoscaling_active(spec):
        return None
    default_metrics = None
    if intent.llm is not None:
        default_metrics = token_metrics(
            spec.get("autoscaling") or {},
            intent.model_name,
            config.llm_waiting_metric_name,
            config.llm_kv_cache_metric_name,
        )
    return render_hpa(
        owner,
        MODEL_KIND,
        intent.name,
        spec,
        config,
        model_labels(intent),
        model=intent.model_name,
        default_metrics=default_metrics,
    )


def endpoint(intent: ModelIntent, namespace: str, tls: bool = False) -> dict[str, str]:
    host = f"{intent.name}.{namespace}.svc"
    out = {
        "service": intent.name,
        "http": f"{'https' if tls else 'http'}://{host}:{HTTP_PORT}/v2/models/{intent.model_name}",
        "grpc": f"{host}:{GRPC_PORT}",
    }
    if intent.llm is not None:
        out["openai"] = openai_url(intent.name, namespace, tls)
    return out
