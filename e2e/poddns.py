"""Cluster DNS for the pod runner's pods, as much of it as a group of pods needs: every pod's name under its
headless Service (`<hostname>.<subdomain>.<namespace>`, `.svc` and `.svc.cluster.local`, which CoreDNS answers in
a cluster), optionally a headless Service's own name for each of its endpoints that is not terminating (as CoreDNS
answers it, one record per pod; `service_entries`), in a hosts file kept current from the API, and a launcher that runs a pod's command with that file at
/etc/hosts in a mount namespace of its own (`unshare --mount`, then a bind mount; the host's /etc/hosts is never
touched). The file is rewritten in place, so a running process sees pods that start after it (glibc reads the
file on every lookup)."""

from __future__ import annotations

import json
import shlex
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ZONE = "cluster.local"


def host_entries(pods: list[dict[str, Any]]) -> list[str]:
    """hosts lines for the pods that have a hostname, a subdomain and an IP (a headless Service's members)."""
    lines = []
    for pod in pods:
        spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
        ip = (pod.get("status") or {}).get("podIP")
        hostname, subdomain = spec.get("hostname") or meta.get("name"), spec.get("subdomain")
        if not (ip and hostname and subdomain) or meta.get("deletionTimestamp"):
            continue
        name = f"{hostname}.{subdomain}.{meta['namespace']}"
        lines.append(f"{ip} {name}.svc.{ZONE} {name}.svc {name}")
    return sorted(lines)


def service_entries(slices: list[dict[str, Any]]) -> list[str]:
    """hosts lines naming a headless Service (`<service>.<namespace>` and its `.svc` forms) at each address of its
    EndpointSlices (those the EndpointSlice controller labels service.kubernetes.io/headless) that is not
    terminating. CoreDNS answers the ready ones only; a starting pod is named here already because a Go resolver
    (the static binaries') keeps /etc/hosts for 5 s after a read, so a name written when the pod turned ready
    could stay unknown that long to a client that looked it up a moment earlier, while CoreDNS follows the
    EndpointSlices at once. Clients that wait for a ready endpoint before they dial (KEDA's interceptor) see no
    difference."""
    lines = set()
    for endpoint_slice in slices:
        meta = endpoint_slice.get("metadata") or {}
        labels = meta.get("labels") or {}
        service = labels.get("kubernetes.io/service-name")
        if not service or "service.kubernetes.io/headless" not in labels:
            continue
        name = f"{service}.{meta['namespace']}"
        for endpoint in endpoint_slice.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("terminating"):
                continue
            for ip in endpoint.get("addresses") or []:
                lines.add(f"{ip} {name}.svc.{ZONE} {name}.svc {name}")
    return sorted(lines)


class PodHosts:
    """`start()` polls the pods (through `kubectl`, a callable returning `kubectl get pods -A -o json`'s output)
    and keeps `path` current; `launcher()` writes a script that runs a command with it as /etc/hosts.
    `endpoint_slices` (a callable returning `kubectl get endpointslices -A -o json`'s output) adds headless
    Services' names; `static` lines are written as given (a name for something outside the cluster's pods)."""

    def __init__(
        self,
        kubectl: Callable[[], str],
        path: Path,
        interval: float = 0.5,
        endpoint_slices: Callable[[], str] | None = None,
        static: Sequence[str] = (),
    ):
        self.kubectl = kubectl
        self.path = path
        self.interval = interval
        self.endpoint_slices = endpoint_slices
        self.static = list(static)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._written: list[str] | None = None

    def refresh(self) -> None:
        entries = [*self.static, *host_entries(json.loads(self.kubectl())["items"])]
        if self.endpoint_slices is not None:
            entries += service_entries(json.loads(self.endpoint_slices())["items"])
        if entries != self._written:
            # in place (not a rename): the processes' bind mounts hold this inode
            with open(self.path, "r+" if self.path.exists() else "w") as f:
                f.seek(0)
                f.write("\n".join(["127.0.0.1 localhost", "::1 localhost", *entries]) + "\n")
                f.truncate()
            self._written = entries

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
            except Exception:
                continue

    def start(self) -> PodHosts:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="poddns", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def launcher(self, target: str, script: Path) -> Path:
        """An executable running `target "$@"` with this hosts file at /etc/hosts (needs root or a user namespace,
        as the pod network's namespace already does)."""
        inner = 'mount --bind "$0" /etc/hosts && exec "$@"'
        script.write_text(
            "#!/bin/sh\n"
            f"exec unshare --mount --propagation private sh -c {shlex.quote(inner)} "
            f'{shlex.quote(str(self.path))} {shlex.quote(target)} "$@"\n'
        )
        script.chmod(0o755)
        return script
