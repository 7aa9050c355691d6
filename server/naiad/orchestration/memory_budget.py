"""`--model-memory-limit host:BYTES[,gpu<N>:BYTES]`: byte quantities, and the per-device budget models must fit."""

from __future__ import annotations

import re

HOST = "host"

# Kubernetes' quantity suffixes (decimal K/M/G/T, binary Ki/Mi/Gi/Ti), case-insensitive, an optional trailing B.
_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtKMGT]i?)?[bB]?\s*$")
_DEVICE = re.compile(r"^(host|gpu([0-9]+))$")


def gpu_device(index: int) -> str:
    """The budget's name of GPU `index`."""
    return f"gpu{index}"


def parse_bytes(text: str) -> int:
    """'512Mi', '2G', '1.5Gi', '1000' -> bytes."""
    match = _QUANTITY.match(str(text))
    if match is None:
        raise ValueError(
            f"invalid byte size '{text}': expected a number with an optional K, M, G, T, Ki, Mi, Gi or Ti"
        )
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def parse_memory(text: str, what: str = "--model-memory-limit") -> dict[str, int]:
    """'host:8Gi,gpu0:20Gi' -> {'host': ..., 'gpu0': ...}; a bare size is the host's."""
    out: dict[str, int] = {}
    for item in str(text).split(","):
        item = item.strip()
        if not item:
            continue
        device, sep, size = item.rpartition(":")
        if not sep:
            device, size = HOST, item
        device = device.strip().lower()
        if _DEVICE.match(device) is None:
            raise ValueError(f"invalid {what} '{text}': unknown device '{device}' (expected host or gpu<N>)")
        if device in out:
            raise ValueError(f"invalid {what} '{text}': device '{device}' is given twice")
        try:
            out[device] = parse_bytes(size)
        except ValueError as exc:
            raise ValueError(f"invalid {what} '{text}': {exc}") from None
    if not out:
        raise ValueError(f"invalid {what} '{text}': expected host:BYTES[,gpu<N>:BYTES]")
    return out


def format_bytes(n: int) -> str:
    """Bytes as a short binary figure for error messages: '1.5 GiB (1610612736 bytes)'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


class MemoryBudget:
    """Byte limits per device ('host', 'gpu0', ...). Devices without a limit are not budgeted."""

    def __init__(self, limits: dict[str, int]):
        self.limits = dict(limits)

    def overflow(self, resident: dict[str, int], incoming: dict[str, int]) -> dict[str, int]:
        """Bytes over each limit if `incoming` joined `resident` (only the devices that would overflow)."""
        over = {}
        for device, limit in self.limits.items():
            excess = resident.get(device, 0) + incoming.get(device, 0) - limit
            if excess > 0:
                over[device] = excess
        return over

    def too_big_alone(self, name: str, incoming: dict[str, int]) -> str | None:
        """Why a model of `incoming` bytes cannot fit even with nothing else loaded (None: it can)."""
        for device, limit in self.limits.items():
            need = incoming.get(device, 0)
            if need > limit:
                return (
                    f"model '{name}' needs {format_bytes(need)} of {device} memory, more than the whole "
                    f"--model-memory-limit of {format_bytes(limit)} for {device}"
                )
        return None
