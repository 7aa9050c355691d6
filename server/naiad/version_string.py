"""A request's model version string, read as Triton reads it (std::stol), with Triton's error texts."""

from __future__ import annotations

import re

from .errors import InvalidArgument

# std::stol: leading C-locale white space, an optional sign, then the longest run of decimal digits; the rest of the
# string is ignored ("2abc" is version 2).
_STOL = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def parse_version(version: str | int | None) -> int:
    """The version a request names: '' (or -1) is the latest ready one, otherwise an integer >= 0.

    The errors are Triton's (GetModelVersionFromString), word for word: "failed to get model version from
    specified version string '<v>' (details: stol), version should be an integral value > 0" when no integer
    starts the string or it does not fit in 64 bits, "invalid model version specified '<v>' , version should be an
    integral value > 0" when it is negative.
    """
    if isinstance(version, int):
        return version
    if not version:
        return -1
    m = _STOL.match(version)
    value = int(m.group(1)) if m else None
    if value is None or not _INT64_MIN <= value <= _INT64_MAX:
        raise InvalidArgument(
            f"failed to get model version from specified version string '{version}' (details: stol), "
            "version should be an integral value > 0"
        )
    if value < 0:
        raise InvalidArgument(
            f"invalid model version specified '{version}' , version should be an integral value > 0"
        )
    return value
