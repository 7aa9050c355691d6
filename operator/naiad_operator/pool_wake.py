"""An InferenceServer with `minReplicas: 0`: KEDA's HTTP add-on scales the pool to zero pods when idle and wakes it
on a request. The operator renders one HTTPScaledObject over the InferenceServer's scale subresource (the add-on's
operator turns it into KEDA's ScaledObject, whose HPA then also scales the pool above one pod, so the operator's
own HPA steps aside); the add-on's interceptor holds requests while the first pod starts and forwards them to the
pool's headless Service."""

from __future__ import annotations

from .naming import API_VERSION, HTTP_PORT, SERVER_KIND, headless_service_name
from .objects import Body, Spec
from .ownership import Owner, child_metadata, pool_labels

HTTP_SCALED_OBJECT_API = "http.keda.sh/v1alpha1"
HTTP_SCALED_OBJECT_KIND = "HTTPScaledObject"
HTTP_SCALED_OBJECT_PLURAL = "httpscaledobjects"

DEFAULT_IDLE_SECONDS = 300
DEFAULT_START_TIMEOUT_SECONDS = 300
DEFAULT_RESPONSE_TIMEOUT_SECONDS = 300
DEFAULT_TARGET_CONCURRENCY = 100

KEDA_SCALES = (
    "KEDA scales this pool (its HTTP add-on's HTTPScaledObject, of the same name), down to zero pods"
)
MISSING_API = (
    "minReplicas: 0 needs KEDA and its HTTP add-on in the cluster (http.keda.sh/v1alpha1 HTTPScaledObject is not "
    "served): the pool keeps its pods until it is"
)


def pool_scales_to_zero(spec: Spec) -> bool:
    """Whether an InferenceServer may go down to zero pods (minReplicas: 0)."""
    return spec.get("minReplicas") == 0


def default_hosts(owner: Owner) -> list[str]:
    """The names a client in the cluster calls the pool Service by."""
    base = f"{owner.name}.{owner.namespace}"
    return [owner.name, base, f"{base}.svc", f"{base}.svc.cluster.local"]


def render_http_scaled_object(owner: Owner, spec: Spec) -> Body:
    """The add-on's HTTPScaledObject: requests for `hosts` sent to the interceptor count towards the pool, wake it
    from zero and hold until the headless Service has a ready endpoint; KEDA scales between 0 and maxReplicas."""
    wake = spec.get("scaleToZero") or {}
    maximum = int(spec.get("maxReplicas") or max(int(spec.get("replicas", 1)), 1))
    return {
        "apiVersion": HTTP_SCALED_OBJECT_API,
        "kind": HTTP_SCALED_OBJECT_KIND,
        "metadata": child_metadata(owner.name, owner, pool_labels(owner.name)),
        "spec": {
            "hosts": list(wake.get("hosts") or default_hosts(owner)),
            "scaleTargetRef": {
                "apiVersion": API_VERSION,
                "kind": SERVER_KIND,
                "name": owner.name,
                "service": headless_service_name(owner.name),
                "port": HTTP_PORT,
            },
            "replicas": {"min": 0, "max": maximum},
            "scaledownPeriod": int(wake.get("idleSeconds") or DEFAULT_IDLE_SECONDS),
            "scalingMetric": {
                "concurrency": {
                    "targetValue": int(wake.get("targetConcurrency") or DEFAULT_TARGET_CONCURRENCY)
                }
            },
            "timeouts": {
                "conditionWait": f"{int(wake.get('startTimeoutSeconds') or DEFAULT_START_TIMEOUT_SECONDS)}s",
                "responseHeader": f"{int(wake.get('responseTimeoutSeconds') or DEFAULT_RESPONSE_TIMEOUT_SECONDS)}s",
            },
        },
    }
