"""Which loaded models to unload to make room: least valuable first, where a model's value is what it would cost
to bring back over how long it has been idle. Pure functions over snapshots of the loaded models.

    reload_cost(m) = load_seconds(m) + bytes(m) / RELOAD_BYTES_PER_SECOND
    value(m)       = reload_cost(m) / (idle_seconds(m) + 1)

The least recently used model goes first unless it is much more expensive to reload than the next one: a model
that took 30 s to load and has been idle 60 s (value 0.49) stays ahead of a 0.1 s model idle 5 s (value 0.02).
Models with requests in flight (or waiting for them) and pinned models are never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RELOAD_BYTES_PER_SECOND = 1 << 30  # a size term for models whose load time undersells them: 1 GiB/s


@dataclass(frozen=True)
class LoadedModel:
    name: str
    memory: dict[str, int] = field(default_factory=dict)  # device -> bytes ('host', 'gpu0', ...)
    load_seconds: float = 0.0
    idle_seconds: float = 0.0
    in_flight: bool = False
    pinned: bool = False


def reload_cost(model: LoadedModel) -> float:
    return model.load_seconds + sum(model.memory.values()) / RELOAD_BYTES_PER_SECOND


def value(model: LoadedModel) -> float:
    return reload_cost(model) / (max(0.0, model.idle_seconds) + 1.0)


def choose_victims(models: list[LoadedModel], overflow: dict[str, int]) -> list[LoadedModel] | None:
    """The models to unload, least valuable first, until every device in `overflow` (device -> bytes over its
    limit) is back within it; None when the evictable models cannot free enough."""
    need = {d: n for d, n in overflow.items() if n > 0}
    if not need:
        return []
    victims = []
    for model in sorted(
        (m for m in models if not m.in_flight and not m.pinned), key=lambda m: (value(m), m.name)
    ):
        if not any(model.memory.get(d, 0) > 0 for d in need):
            continue  # it holds nothing on a device that is over
        victims.append(model)
        for device in list(need):
            need[device] -= model.memory.get(device, 0)
            if need[device] <= 0:
                del need[device]
        if not need:
            return victims
    return None


def idle_expired(model: LoadedModel, idle_limit: float) -> bool:
    """Whether a model with an idle time (`idle_limit` > 0) has gone that long without requests."""
    return idle_limit > 0 and not model.pinned and not model.in_flight and model.idle_seconds >= idle_limit
