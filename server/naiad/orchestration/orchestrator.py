"""The repository's model orchestration: every load is admitted within the memory budget (idle models are evicted
to make room), measured after warm-up and counted by cause; models with an idle time are unloaded after it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ..errors import InvalidArgument, Unavailable
from .eviction import LoadedModel, choose_victims, idle_expired
from .measure import MemoryProbe, MemorySnapshot, worker_pids
from .memory_budget import MemoryBudget, format_bytes
from .metrics import OrchestrationMetrics
from .model_settings import model_settings

log = logging.getLogger("naiad.orchestration")

IDLE_SWEEP_SECONDS = 0.5


@dataclass
class LoadTicket:
    """One admitted load: what was reserved, and the memory before it."""

    name: str
    cause: str
    before: MemorySnapshot
    locked: bool


class ModelOrchestrator:
    """Owned by the repository, which calls `admit` before building a model and `loaded`/`failed` after."""

    def __init__(self, repository, gpu_count: int = 0, budget: MemoryBudget | None = None):
        self.repository = repository
        self.budget = budget
        self.metrics = OrchestrationMetrics()
        self.probe = MemoryProbe(gpu_count)
        self.waiting: dict[str, int] = {}  # model -> requests waiting for it to load (the on-demand loader's)
        # Loads are serialised while a budget is kept: admission decisions and RSS deltas need one at a time.
        self._load_lock = asyncio.Lock()
        self._sweeper: asyncio.Task | None = None
        self._started = False

    # ---- the figures ----
    def memory_of(self, rec) -> tuple[dict[str, int], str]:
        """A model's bytes per device and where they come from: measured, else declared in its config."""
        if rec.memory_measured:
            return rec.memory, "measured"
        return rec.settings.declared_memory, "declared"

    def index_fields(self, rec) -> dict:
        """The memory fields of a READY repository index entry."""
        memory, source = self.memory_of(rec)
        gpus = {d[3:]: n for d, n in sorted(memory.items()) if d.startswith("gpu")}
        return {
            "host_memory_bytes": memory.get("host", 0),
            "gpu_memory_bytes": sum(gpus.values()),
            "gpu_memory_bytes_by_device": gpus,
            "memory_source": source,
        }

    def resident_models(self) -> list[tuple[str, dict[str, int], str]]:
        out = []
        for rec in self.repository.records.values():
            if rec.versions:
                memory, source = self.memory_of(rec)
                out.append((rec.name, memory, source))
        return out

    def resident_total(self, exclude: str = "") -> dict[str, int]:
        total: dict[str, int] = {}
        for name, memory, _ in self.resident_models():
            if name != exclude:
                for device, nbytes in memory.items():
                    total[device] = total.get(device, 0) + nbytes
        return total

    def in_flight(self, rec) -> bool:
        if self.waiting.get(rec.name):
            return True
        return any(mv.stats.pending for mv in rec.versions.values())

    def idle_seconds(self, rec, now: float) -> float:
        """Wall-clock seconds since the model's last finished request (or its load, if none since)."""
        last = rec.loaded_at
        for mv in rec.versions.values():
            mv.stats.flush()
            last = max(last, mv.stats.last_inference_ms / 1000.0)
        return max(0.0, now - last)

    def _snapshot(self, exclude: str) -> list[LoadedModel]:
        now = time.time()
        out = []
        for rec in self.repository.records.values():
            if not rec.versions or rec.name == exclude or self.repository.busy(rec.name):
                continue
            memory, _ = self.memory_of(rec)
            out.append(
                LoadedModel(
                    rec.name,
                    dict(memory),
                    rec.load_seconds,
                    self.idle_seconds(rec, now),
                    self.in_flight(rec),
                    rec.settings.pinned,
                )
            )
        return out

    # ---- the load lifecycle (called by the repository under the model's lock) ----
    async def admit(self, rec, config, cause: str) -> LoadTicket:
        """Make room for `rec` within the budget (evicting idle models) before it is built; refuse it when it
        cannot fit even alone or when the models that would have to go are busy or pinned."""
        rec.settings = model_settings(config) if config is not None else rec.settings
        locked = False
        if self.budget is not None:
            await self._load_lock.acquire()
            locked = True
            try:
                incoming, _ = self.memory_of(rec)
                why = self.budget.too_big_alone(rec.name, incoming)
                if why is not None:
                    raise InvalidArgument(f"failed to load '{rec.name}', {why}")
                await self._make_room(rec.name, incoming)
            except BaseException:
                self._load_lock.release()
                raise
        return LoadTicket(rec.name, cause, self.probe.snapshot(), locked)

    async def _make_room(self, name: str, incoming: dict[str, int]) -> None:
        assert self.budget is not None
        overflow = self.budget.overflow(self.resident_total(exclude=name), incoming)
        if not overflow:
            return
        models = self._snapshot(exclude=name)
        victims = choose_victims(models, overflow)
        if victims is None:
            held = ", ".join(
                f"'{m.name}' ({'pinned' if m.pinned else 'busy' if m.in_flight else 'idle'}, "
                f"{format_bytes(sum(m.memory.values()))})"
                for m in models
            )
            raise Unavailable(
                f"cannot load '{name}' now: it needs "
                + ", ".join(f"{format_bytes(incoming.get(d, 0))} of {d}" for d in overflow)
                + " within --model-memory-limit "
                + ", ".join(f"{d}:{format_bytes(n)}" for d, n in self.budget.limits.items())
                + f", and the models holding it cannot be unloaded: {held or 'none'}"
            )
        for victim in victims:
            await self.evict(victim.name, "memory")

    def loaded(self, ticket: LoadTicket, rec, seconds: float) -> None:
        """Measure the model just built (warm-up done) and count its load."""
        try:
            if rec.config is not None and rec.config.platform == "ensemble":
                rec.memory = {}  # its memory is its composing models'
            else:
                rec.memory = self.probe.measure(ticket.before, worker_pids(rec.versions.values()))
            rec.memory_measured = True
            rec.loaded_at = time.time()
            self._ensure_sweeper()
            self.metrics.load(rec.name, ticket.cause, seconds, True)
            log.info(
                "model '%s' loaded (%s) in %.3f s, measured memory: %s",
                rec.name,
                ticket.cause,
                seconds,
                ", ".join(f"{d} {format_bytes(n)}" for d, n in sorted(rec.memory.items())) or "none",
            )
        finally:
            self._release(ticket)

    def failed(self, ticket: LoadTicket | None, name: str, cause: str, seconds: float) -> None:
        self.metrics.load(name, cause, seconds, False)
        if ticket is not None:
            self._release(ticket)

    def _release(self, ticket: LoadTicket) -> None:
        if ticket.locked:
            ticket.locked = False
            self._load_lock.release()

    async def settle(self, name: str) -> str | None:
        """After a load: evict idle models if its measured size took the server over the budget. Returns why the
        model itself must go (it cannot fit even alone), else None."""
        if self.budget is None:
            return None
        rec = self.repository.records.get(name)
        if rec is None or not rec.versions:
            return None
        why = self.budget.too_big_alone(name, rec.memory)
        if why is not None:
            return why
        async with self._load_lock:
            overflow = self.budget.overflow(self.resident_total(), {})
            if not overflow:
                return None
            victims = choose_victims(self._snapshot(exclude=name), overflow)
            if victims is None:
                log.warning(
                    "models hold more than --model-memory-limit after loading '%s' (over by %s); the others "
                    "are busy or pinned",
                    name,
                    ", ".join(f"{d} {format_bytes(n)}" for d, n in overflow.items()),
                )
                return None
            for victim in victims:
                await self.evict(victim.name, "memory")
        return None

    async def evict(self, name: str, reason: str) -> None:
        rec = self.repository.records.get(name)
        if rec is None or not rec.versions or self.repository.busy(name):
            # (a model being loaded right now may be waiting for the load lock this caller holds: leave it)
            return
        age = max(0.0, time.time() - rec.loaded_at)
        memory, _ = self.memory_of(rec)
        log.info(
            "evicting model '%s' (%s) after %.1f s loaded, freeing %s",
            name,
            reason,
            age,
            ", ".join(f"{d} {format_bytes(n)}" for d, n in sorted(memory.items())) or "nothing measured",
        )
        self.metrics.eviction(name, reason, age)
        await self.repository.unload(name)

    # ---- idle unload ----
    def start(self) -> None:
        """The server is up: from now on models with an idle time are swept (by a task that runs only while one
        is loaded, so that a server without them never wakes for it)."""
        self._started = True
        self._ensure_sweeper()

    def _idle_models_loaded(self) -> bool:
        return any(rec.versions and rec.settings.idle_seconds > 0 for rec in self.repository.records.values())

    def _ensure_sweeper(self) -> None:
        if self._started and self._sweeper is None and self._idle_models_loaded():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        try:
            while self._idle_models_loaded():
                await asyncio.sleep(IDLE_SWEEP_SECONDS)
                try:
                    await self.sweep_idle()
                except Exception:
                    log.exception("idle model sweep failed")
        finally:
            self._sweeper = None

    async def sweep_idle(self) -> None:
        now = time.time()
        for rec in list(self.repository.records.values()):
            limit = rec.settings.idle_seconds
            if limit <= 0 or not rec.versions or self.repository.busy(rec.name):
                continue
            model = LoadedModel(
                rec.name,
                idle_seconds=self.idle_seconds(rec, now),
                in_flight=self.in_flight(rec),
                pinned=rec.settings.pinned,
            )
            if idle_expired(model, limit):
                await self.evict(rec.name, "idle")

    async def close(self) -> None:
        self._started = False
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
