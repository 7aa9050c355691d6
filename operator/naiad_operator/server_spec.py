"""Reading an InferenceServer spec: what the operator refuses in it, and the values it derives from it."""

from __future__ import annotations

import math
from typing import Any

from .naming import (
    GRPC_PORT,
    HTTP_PORT,
    MAX_SERVER_NAME,
    METRICS_PORT,
    MODEL_REPOSITORY_PATH,
    models_claim_name,
    name_problems,
)
from .objects import Spec
from .quantity import parse_quantity
from .security import CONTROL_GROUPS, restriction_args, tls_args, tls_secret_name

# Flags the operator sets itself: a user value would break model control or the ports Services point at.
RESERVED_FLAGS = (
    "--model-control-mode",
    "--model-repository",
    "--model-store",
    "--http-port",
    "--grpc-port",
    "--metrics-port",
    "--allow-http",
    "--allow-grpc",
    "--allow-metrics",
    "--strict-readiness",
    "--storage-cache-dir",
)
# Prefixes of flags the operator sets from spec.tls and the control credential.
RESERVED_PREFIXES = (
    "--http-use-ssl",
    "--grpc-use-ssl",
    "--metrics-use-ssl",
    "--http-server-",
    "--grpc-server-",
)

# Where a pool whose repository is an s3:// or https:// URI copies its models (an emptyDir).
STORAGE_CACHE_PATH = "/var/cache/naiad"


# --- validation -------------------------------------------------------------------------------------------------


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def _int_or_percent(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, str) and value.endswith("%") and value[:-1].isdigit()


def server_spec_problems(name: str, spec: Spec) -> list[str]:
    """What in an InferenceServer spec the operator cannot render (reported in status, never retried)."""
    problems = name_problems(name, MAX_SERVER_NAME)
    for arg in spec.get("args") or []:
        if _flag_name(arg) in RESERVED_FLAGS or (
            tls_secret_name(spec) and _flag_name(arg).startswith(RESERVED_PREFIXES)
        ):
            problems.append(f"args: {_flag_name(arg)} is set by the operator and cannot be overridden")
        elif _flag_name(arg) in ("--http-restricted-api", "--grpc-restricted-protocol"):
            value = arg.partition("=")[2]
            groups = {g.strip() for g in value.partition(":")[0].split(",")}
            if groups & set(CONTROL_GROUPS):
                problems.append(
                    f"args: {_flag_name(arg)} may not restrict {', '.join(sorted(groups & set(CONTROL_GROUPS)))}: "
                    "the operator restricts the control APIs to its own credential"
                )
    minimum, maximum = spec.get("minReplicas"), spec.get("maxReplicas")
    if minimum is not None and maximum is not None and minimum > maximum:
        problems.append(f"minReplicas ({minimum}) exceeds maxReplicas ({maximum})")
    repository = spec.get("modelRepository") or {}
    if repository.get("claimName") and repository.get("create"):
        problems.append("modelRepository: set either claimName or create, not both")
    if repository.get("uri") and (repository.get("claimName") or repository.get("create")):
        problems.append("modelRepository: set either uri or a claim (claimName, create), not both")
    if repository.get("secretRef") and not repository.get("uri"):
        problems.append("modelRepository: secretRef holds object-store credentials; it needs uri")
    for field in ("shmSize",):
        if spec.get(field) is not None:
            try:
                parse_quantity(spec[field])
            except ValueError as error:
                problems.append(f"{field}: {error}")
    max_unavailable = (spec.get("disruptionBudget") or {}).get("maxUnavailable")
    if max_unavailable is not None and not _int_or_percent(max_unavailable):
        problems.append(
            f"disruptionBudget.maxUnavailable: {max_unavailable!r} is neither a count nor a percentage like '25%'"
        )
    capacity = spec.get("capacity") or {}
    if capacity.get("memory") is not None:
        try:
            parse_quantity(capacity["memory"])
        except ValueError as error:
            problems.append(f"capacity.memory: {error}")
    return problems


def desired_replicas(spec: Spec) -> int:
    """spec.replicas kept within minReplicas/maxReplicas when those are set."""
    replicas = int(spec.get("replicas", 1))
    if spec.get("minReplicas") is not None:
        replicas = max(replicas, int(spec["minReplicas"]))
    if spec.get("maxReplicas") is not None:
        replicas = min(replicas, int(spec["maxReplicas"]))
    return replicas


def repository_path(spec: Spec) -> str:
    return (spec.get("modelRepository") or {}).get("path") or MODEL_REPOSITORY_PATH


def repository_uri(spec: Spec) -> str | None:
    """The pool's object-store repository (s3://... or https://...), or None when it reads a path."""
    uri = (spec.get("modelRepository") or {}).get("uri")
    return str(uri) if uri else None


def repository_secret(spec: Spec) -> str | None:
    """The Secret whose keys (AWS_ACCESS_KEY_ID, ...) become the server's environment, or None (pod identity)."""
    return ((spec.get("modelRepository") or {}).get("secretRef") or {}).get("name") or None


def repository_claim(server: str, spec: Spec) -> str | None:
    """Name of the PVC that holds the pool's repository, or None when the repository is in the image."""
    repository = spec.get("modelRepository") or {}
    if repository.get("uri"):
        return None
    if repository.get("claimName"):
        return str(repository["claimName"])
    if repository.get("create"):
        return models_claim_name(server)
    return None


# After its preStop sleep, a server goes on listening while new connections still reach it and stops once none has
# come for this long: on a busy node the Service's endpoint change can reach kube-proxy after the sleep is over
# (an e2e rollout under CI load saw 4 "connection refused" at one instant). The kubelet's readiness (every 5 s) and
# liveness (10 s) probes come further apart than this, so an unrouted pod stops listening within seconds.
DRAIN_QUIET_SECONDS = 2.0


def server_args(spec: Spec, restricted: bool = False) -> list[str]:
    """`naiad serve` arguments: explicit model control (the operator loads models live), fixed ports, the control
    APIs restricted to the installation's credential (read from the environment: never in the args), TLS from
    spec.tls, then the user's extra flags.

    Strict readiness is off: with it, one model that failed to load (or, on some servers, one that was unloaded)
    takes the whole pod, and every other model on it, out of service. Per-model availability is what the model
    labels and the models-ready readiness gate express instead.

    An s3:// or https:// repository is copied into an emptyDir; its credentials come from the environment
    (container_env), never from these arguments."""
    uri = repository_uri(spec)
    storage = [f"--model-repository={uri}", f"--storage-cache-dir={STORAGE_CACHE_PATH}"] if uri else []
    return [
        "serve",
        *(storage or [f"--model-repository={repository_path(spec)}"]),
        "--model-control-mode=explicit",
        "--strict-readiness=false",
        f"--http-port={HTTP_PORT}",
        f"--grpc-port={GRPC_PORT}",
        f"--metrics-port={METRICS_PORT}",
        f"--drain-quiet-secs={DRAIN_QUIET_SECONDS:g}",
        *(restriction_args() if restricted else []),
        *(tls_args() if tls_secret_name(spec) else []),
        *frontend_workers_args(spec),
        *[str(arg) for arg in spec.get("args") or []],
    ]


def frontend_workers(spec: Spec) -> int | None:
    """Frontend worker processes for the pod's CPUs: its CPU limit (the cgroup quota the server would read), else
    its request, rounded up, less one CPU for the engine process (on 2 CPUs, two workers beside the engine served
    0.86x the small requests of one process: bench/README.md, "Frontend workers"); None when the spec sets
    neither (the server then reads its own cgroup)."""
    resources = spec.get("resources") or {}
    cpu = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get("cpu")
    if cpu is None:
        return None
    try:
        cpus = parse_quantity(cpu)
    except (TypeError, ValueError):
        return None
    return max(1, math.ceil(cpus) - 1)


def frontend_workers_args(spec: Spec) -> list[str]:
    """`--frontend-workers=N` from the pod's CPUs, unless the user's args set it."""
    if any(_flag_name(str(a)) == "--frontend-workers" for a in spec.get("args") or []):
        return []
    n = frontend_workers(spec)
    return [] if n is None else [f"--frontend-workers={n}"]


def autoscaling_active(spec: Spec) -> bool:
    """An HPA exists when maxReplicas is above minReplicas (default 1) and autoscaling is not disabled."""
    if (spec.get("autoscaling") or {}).get("enabled") is False:
        return False
    maximum = spec.get("maxReplicas")
    return maximum is not None and int(maximum) > int(spec.get("minReplicas") or 1)
