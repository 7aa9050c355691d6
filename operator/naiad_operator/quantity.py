"""Kubernetes resource quantities ("16Gi", "500M", "1.5e9", 1024) parsed to numbers for placement arithmetic."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES = {
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)$"
)


def parse_quantity(value: str | float) -> Decimal:
    """The quantity's value in base units; raises ValueError for text that is not a quantity."""
    if isinstance(value, bool):
        raise TypeError(f"not a quantity: {value!r}")
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    match = _QUANTITY.match(value.strip())
    if not match:
        raise ValueError(f"not a quantity: {value!r} (expected e.g. 512Mi, 16Gi, 1.5e9)")
    number, suffix = match.groups()
    try:
        return Decimal(number) * _SUFFIXES[suffix]
    except InvalidOperation as error:
        raise ValueError(f"not a quantity: {value!r}") from error


def quantity_bytes(value: str | float | None) -> int:
    """A memory quantity as whole bytes (0 when unset)."""
    if value is None:
        return 0
    return int(parse_quantity(value).to_integral_value(rounding="ROUND_CEILING"))
