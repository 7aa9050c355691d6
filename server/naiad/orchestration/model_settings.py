"""A model's orchestration parameters in its config: declared memory, pinned, idle time."""

from __future__ import annotations

from dataclasses import dataclass, field

from tritonclient.grpc import model_config_pb2 as mc

from ..errors import InvalidArgument
from .memory_budget import parse_bytes, parse_memory

MEMORY_PARAMETER = "NAIAD_MEMORY"  # declared size until measured: "2Gi" (host) or "host:1Gi,gpu0:4Gi"
PINNED_PARAMETER = "NAIAD_PINNED"  # "true": never evicted, never unloaded for idleness
IDLE_PARAMETER = "NAIAD_IDLE_SECONDS"  # unload after this long without a request (0 / absent: never)


@dataclass(frozen=True)
class ModelSettings:
    declared_memory: dict[str, int] = field(default_factory=dict)
    pinned: bool = False
    idle_seconds: float = 0.0


def model_settings(config: mc.ModelConfig | None) -> ModelSettings:
    """The orchestration parameters of `config` (defaults for None); a bad value is the load's error."""
    if config is None:
        return ModelSettings()
    params = config.parameters
    declared: dict[str, int] = {}
    pinned = False
    idle = 0.0
    try:
        if MEMORY_PARAMETER in params:
            text = params[MEMORY_PARAMETER].string_value
            declared = parse_memory(text, MEMORY_PARAMETER) if ":" in text else {"host": parse_bytes(text)}
        if PINNED_PARAMETER in params:
            value = params[PINNED_PARAMETER].string_value.strip().lower()
            if value not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"{PINNED_PARAMETER} must be true or false, got '{value}'")
            pinned = value in ("true", "1", "yes")
        if IDLE_PARAMETER in params:
            text = params[IDLE_PARAMETER].string_value
            try:
                idle = float(text)
            except ValueError:
                raise ValueError(f"{IDLE_PARAMETER} must be a number of seconds, got '{text}'") from None
            if idle < 0:
                raise ValueError(f"{IDLE_PARAMETER} must be >= 0, got '{text}'")
    except ValueError as exc:
        raise InvalidArgument(f"failed to load '{config.name}', model parameter: {exc}") from None
    return ModelSettings(declared, pinned, idle)
