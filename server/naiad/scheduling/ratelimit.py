"""Rate limiter (`--rate-limit execution_count`): an instance executes only when the resources its instance
group's `rate_limiter` names are free. Waiting instances are served by `rate_limiter.priority` (lower first),
then in arrival order.

Resource counts come from `--rate-limit-resource <name>:<count>[:<device>]`; a resource not given there gets
the largest count any single instance asks for, as in Triton. Non-global resources are counted per device.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

from ..errors import InvalidArgument


def parse_resources(items: list[str]) -> dict[tuple[str, int | None], int]:
    out: dict[tuple[str, int | None], int] = {}
    for item in items:
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1].isdigit():
            raise ValueError(f"invalid --rate-limit-resource '{item}': expected <name>:<count>[:<device>]")
        device = None
        if len(parts) == 3:
            if not parts[2].isdigit():
                raise ValueError(f"invalid device in --rate-limit-resource '{item}'")
            device = int(parts[2])
        out[(parts[0], device)] = int(parts[1])
    return out


class RateLimiter:
    def __init__(self, resources: dict[tuple[str, int | None], int] | None = None):
        self.configured = dict(resources or {})
        self.available: dict[tuple[str, int | None], int] = {}
        self._waiters: list = []
        self._seq = itertools.count()

    def _needs(self, inst) -> list[tuple[tuple[str, int | None], int]]:
        rl = inst.group.rate_limiter
        return [((r.name, None if getattr(r, "global") else inst.device_id), r.count) for r in rl.resources]

    def _capacity(self, key: tuple[str, int | None]) -> int | None:
        if key in self.configured:
            return self.configured[key]
        name, device = key
        return self.configured.get((name, None)) if device is not None else None

    def register(self, inst) -> None:
        """Account for an instance's needs when it is created (sets default counts)."""
        for key, count in self._needs(inst):
            cap = self._capacity(key)
            if cap is not None and count > cap:
                raise InvalidArgument(
                    f"instance '{inst.name}' needs {count} of rate-limiter resource '{key[0]}', but only "
                    f"{cap} are available (--rate-limit-resource)"
                )
            if key not in self.available:
                self.available[key] = cap if cap is not None else count
            elif cap is None and count > self.available[key]:
                self.available[key] = count

    def _fits(self, needs) -> bool:
        return all(self.available.get(k, 0) >= c for k, c in needs)

    async def acquire(self, inst) -> None:
        needs = self._needs(inst)
        if not needs:
            return
        if not self._waiters and self._fits(needs):
            self._take(needs)
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (inst.group.rate_limiter.priority, next(self._seq), needs, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release_needs(needs)
            raise

    def _take(self, needs) -> None:
        for k, c in needs:
            self.available[k] -= c

    def release(self, inst) -> None:
        self.release_needs(self._needs(inst))

    def release_needs(self, needs) -> None:
        for k, c in needs:
            self.available[k] += c
        while self._waiters:
            _, _, w_needs, fut = self._waiters[0]
            if fut.done():
                heapq.heappop(self._waiters)
                continue
            if not self._fits(w_needs):
                break
            heapq.heappop(self._waiters)
            self._take(w_needs)
            fut.set_result(None)
