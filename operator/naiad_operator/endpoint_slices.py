"""Which pods a Service's EndpointSlices send traffic to (what kube-proxy routes to): the check that a pod has
left a model's Service before its copy is unloaded."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .kube import KubeClient, KubeError

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def routed_endpoints(slices: Iterable[Mapping[str, Any]]) -> set[str]:
    """Pod names and addresses of the endpoints that receive traffic: ready ones, or serving ones (kube-proxy falls
    back to serving terminating endpoints when a Service has no ready one)."""
    out: set[str] = set()
    for endpoint_slice in slices:
        for endpoint in endpoint_slice.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("ready") is False and not conditions.get("serving"):
                continue
            ref = endpoint.get("targetRef") or {}
            if ref.get("kind") == "Pod" and ref.get("name"):
                out.add(str(ref["name"]))
            out.update(str(a) for a in endpoint.get("addresses") or [])
    return out


async def service_endpoints(kube: KubeClient, namespace: str, services: Iterable[str]) -> set[str] | None:
    """Pod names and addresses the Services' EndpointSlices route to; None when they cannot be read (no RBAC on
    discovery.k8s.io endpointslices, API errors)."""
    out: set[str] = set()
    for service in services:
        try:
            slices = await kube.list(
                "discovery.k8s.io/v1", "EndpointSlice", namespace, f"{SERVICE_NAME_LABEL}={service}"
            )
        except KubeError:
            return None
        out |= routed_endpoints(slices)
    return out
