"""In-memory stand-ins for the operator's own two clients (KubeClient and ModelControlClient), for tests of the
placement pass and the handlers. They implement the calls the operator makes, not Kubernetes' semantics."""

from __future__ import annotations

import asyncio
import copy

from naiad_operator.control import IndexEntry, ModelControlError, ServerUnreachable
from naiad_operator.kube import KubeError

NS = "ml"
API = "naiad.dev/v1alpha1"


def merge(target, patch):
    """RFC 7386 merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeKube:
    """Objects in a dict; the subset of KubeClient the pass calls."""

    def __init__(self):
        self.objects = {}
        self.status_writes = []
        self.applied = []
        self.deleted = []
        self.apis = set()

    def add(self, body):
        body = copy.deepcopy(body)
        meta = body["metadata"]
        meta.setdefault("namespace", NS)
        meta.setdefault("uid", f"uid-{meta['name']}")
        meta.setdefault("generation", 1)
        self.objects[(body["apiVersion"], body["kind"], meta["namespace"], meta["name"])] = body
        return body

    def obj(self, api_version, kind, name):
        return self.objects.get((api_version, kind, NS, name))

    async def get(self, api_version, kind, namespace, name):
        found = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(found)

    async def list(self, api_version, kind, namespace, label_selector=None):
        wanted = dict(p.split("=", 1) for p in label_selector.split(",")) if label_selector else {}
        out = []
        for (av, k, ns, _), body in sorted(self.objects.items()):
            labels = body["metadata"].get("labels") or {}
            if (av, k, ns) == (api_version, kind, namespace) and all(
                labels.get(a) == b for a, b in wanted.items()
            ):
                out.append(copy.deepcopy(body))
        return out

    async def patch(self, api_version, kind, namespace, name, patch, *, subresource=None, patch_type="merge"):
        body = self.objects.get((api_version, kind, namespace, name))
        if body is None:
            raise KubeError(404, "NotFound", name)
        if patch_type == "strategic" and subresource == "status":
            conditions = body.setdefault("status", {}).setdefault("conditions", [])
            for cond in patch["status"]["conditions"]:
                conditions[:] = [c for c in conditions if c["type"] != cond["type"]] + [cond]
        else:
            merge(body, patch)
        return copy.deepcopy(body)

    async def apply(self, body):
        meta = body["metadata"]
        key = (body["apiVersion"], body["kind"], meta["namespace"], meta["name"])
        self.applied.append(copy.deepcopy(body))
        if key in self.objects:
            merge(self.objects[key], copy.deepcopy(body))
        else:
            self.add(body)
        return copy.deepcopy(self.objects[key])

    async def delete(self, api_version, kind, namespace, name):
        self.deleted.append((kind, name))
        return self.objects.pop((api_version, kind, namespace, name), None) is not None

    async def api_available(self, group_version, plural):
        return group_version in self.apis

    async def apply_status(self, api_version, kind, namespace, name, status):
        self.status_writes.append((kind, name, copy.deepcopy(status)))
        return await self.patch(api_version, kind, namespace, name, {"status": status})


class FakeServers:
    """Model-control API of every pod IP: what each has loaded, which loads fail, which pods do not answer."""

    def __init__(self):
        self.loaded: dict[str, dict[str, str]] = {}
        self.failing: set[tuple[str, str]] = set()
        self.down: set[str] = set()
        self.calls: list[tuple[str, str, str]] = []
        self.configs: dict[tuple[str, str], object] = {}
        self.load_seconds = 0.0  # how long each load takes

    async def index(self, ip):
        if ip in self.down:
            raise ServerUnreachable(f"{ip} down")
        return [
            IndexEntry(name, version, "READY") for name, version in sorted(self.loaded.get(ip, {}).items())
        ]

    async def load(self, ip, model, config=None):
        self.calls.append(("load", ip, model))
        if self.load_seconds:
            await asyncio.sleep(self.load_seconds)
        if (ip, model) in self.failing:
            raise ModelControlError(f"failed to load '{model}'", 400)
        self.configs[(ip, model)] = config
        version = "1"
        if config and "version_policy" in config:
            version = str(config["version_policy"]["specific"]["versions"][0])
        self.loaded.setdefault(ip, {})[model] = version

    async def unload(self, ip, model):
        self.calls.append(("unload", ip, model))
        self.loaded.get(ip, {}).pop(model, None)
