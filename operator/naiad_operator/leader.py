"""Leader election over a coordination.k8s.io/v1 Lease, as client-go's leaderelection package does it: one
replica holds the Lease and renews it; the others poll it and take it over once it has not been renewed for a
whole lease duration (measured on their own clock, so clock skew between nodes does not matter). A leader that
stops releases the Lease, so a standby takes over at its next poll."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from .kube import KubeClient, KubeError

log = logging.getLogger(__name__)

LEASE_API = "/apis/coordination.k8s.io/v1"


def lease_path(namespace: str, name: str | None = None) -> str:
    path = f"{LEASE_API}/namespaces/{quote(namespace)}/leases"
    return path if name is None else f"{path}/{quote(name)}"


def micro_time(when: float) -> str:
    """RFC 3339 with microseconds: the MicroTime format of acquireTime/renewTime."""
    return datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class ElectionTiming:
    # A standby takes the Lease once it saw no renewal for this long.
    lease_duration: float = 10.0
    # The leader gives up (and stops reconciling) when it could not renew for this long; < lease_duration, so
    # it stops before anyone else may start.
    renew_deadline: float = 7.0
    # Polling and renewal period.
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period}, {self.renew_deadline}, {self.lease_duration}"
            )


class LeaderElector:
    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        timing: ElectionTiming | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timing = timing or ElectionTiming()
        self._clock = clock
        self._wall = wall_clock
        # The last Lease record seen and when (on our clock) it last changed.
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self.leading = False
        self.transitions = 0
        self._lease: dict[str, Any] | None = None  # the Lease as this replica last wrote it

    def _spec(self, lease: dict[str, Any] | None, acquired: bool) -> dict[str, Any]:
        old = (lease or {}).get("spec") or {}
        now = micro_time(self._wall())
        transitions = int(old.get("leaseTransitions") or 0)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.timing.lease_duration)),
            "acquireTime": now if acquired else old.get("acquireTime") or now,
            "renewTime": now,
            "leaseTransitions": transitions + 1 if acquired and lease is not None else transitions,
        }

    async def _renew(self) -> bool:
        """The leader's renewal: one PUT of the Lease it wrote last (its resourceVersion proves nobody else wrote
        it since), no GET. False on any failure; the caller then reads the Lease."""
        lease = self._lease
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return False
        lease = {**lease, "spec": self._spec(lease, acquired=False)}
        try:
            self._lease = await self.kube.request("PUT", lease_path(self.namespace, self.name), body=lease)
        except KubeError:
            self._lease = None
            return False
        return True

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease afterwards."""
        if self.leading and await self._renew():
            return True
        try:
            lease = await self.kube.request("GET", lease_path(self.namespace, self.name))
        except KubeError as error:
            if error.status != 404:
                raise
            lease = None
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(None, acquired=True),
            }
            try:
                self._lease = await self.kube.request("POST", lease_path(self.namespace), body=body)
            except KubeError as error:
                if error.status == 409:  # another replica created it first
                    return False
                raise
            self._observed, self._observed_at = None, self._clock()
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, self._clock()
        duration = float(spec.get("leaseDurationSeconds") or self.timing.lease_duration)
        mine = holder == self.identity
        if holder and not mine and self._clock() < self._observed_at + duration:
            return False  # someone else holds it and renewed it within the lease duration
        lease["spec"] = self._spec(lease, acquired=not mine)
        try:
            # A PUT with the resourceVersion just read: of two replicas racing for an expired Lease, one gets 409.
            self._lease = await self.kube.request("PUT", lease_path(self.namespace, self.name), body=lease)
        except KubeError as error:
            if error.status == 409:
                return False
            raise
        if not mine:
            self.transitions += 1
        return True

    async def _attempt(self) -> bool:
        try:
            return await self.try_acquire_or_renew()
        except KubeError as error:
            log.warning("leader election: Lease %s/%s: %s", self.namespace, self.name, error)
            return False

    async def acquire(self) -> None:
        """Wait until this replica leads."""
        log.info("leader election: %s waits for Lease %s/%s", self.identity, self.namespace, self.name)
        while not await self._attempt():
            await asyncio.sleep(self.timing.retry_period)
        self.leading = True
        log.info("leader election: %s leads (Lease %s/%s)", self.identity, self.namespace, self.name)

    async def hold(self) -> None:
        """Renew every retry period; returns when a renewal has not succeeded for the renew deadline (or
        another replica took the Lease): the caller must stop reconciling at once."""
        last = self._clock()
        while True:
            await asyncio.sleep(self.timing.retry_period)
            if await self._attempt():
                last = self._clock()
            elif self._observed is not None and self._observed[0] not in ("", self.identity):
                log.error("leader election: %s lost Lease to %s", self.identity, self._observed[0])
                break
            elif self._clock() - last >= self.timing.renew_deadline:
                log.error("leader election: %s could not renew its Lease in time", self.identity)
                break
        self.leading = False

    async def release(self) -> None:
        """Give the Lease up (a stopping leader), so a standby takes over at its next poll instead of after a
        lease duration."""
        if not self.leading:
            return
        self.leading = False
        try:
            lease = await self.kube.request("GET", lease_path(self.namespace, self.name))
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            lease["spec"] = {
                **spec,
                "holderIdentity": None,
                "leaseDurationSeconds": 1,
                "renewTime": micro_time(self._wall()),
            }
            await self.kube.request("PUT", lease_path(self.namespace, self.name), body=lease)
            log.info("leader election: %s released Lease %s/%s", self.identity, self.namespace, self.name)
        except KubeError as error:
            log.warning("leader election: releasing Lease %s/%s: %s", self.namespace, self.name, error)
