"""The object that owns rendered children (garbage collection), and the labels and metadata each child carries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .naming import SERVER_LABEL, selector_string
from .objects import Body


@dataclass(frozen=True)
class Owner:
    """The object that owns rendered children (garbage collection through owner references)."""

    api_version: str
    kind: str
    name: str
    uid: str
    namespace: str

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(body["apiVersion"], body["kind"], meta["name"], meta["uid"], meta["namespace"])

    def reference(self) -> Body:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def pool_labels(server: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "naiad-server",
        "app.kubernetes.io/instance": server,
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/managed-by": "naiad-operator",
        SERVER_LABEL: server,
    }


def pool_selector(server: str) -> dict[str, str]:
    return {SERVER_LABEL: server}


def pool_selector_string(server: str) -> str:
    return selector_string(pool_selector(server))


def child_metadata(
    name: str,
    owner: Owner,
    labels: Mapping[str, str],
    annotations: Mapping[str, str] | None = None,
    owned: bool = True,
) -> Body:
    meta: Body = {"name": name, "namespace": owner.namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    if owned:
        meta["ownerReferences"] = [owner.reference()]
    return meta
