"""The sequence batcher's control tensors (`sequence_batching.control_input`), validated as Triton does, and
correlation IDs as sequence keys.

Control inputs are synthesised per request: START/END/READY from the flags (READY is always true: Naiad
never pads a batch with not-ready filler requests), CORRID from the correlation ID in the configured data
type; shape [1], or [1, 1] when max_batch_size > 0 so that batching gives [B, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..config import data_type_name
from ..errors import InvalidArgument
from ..tensors import config_to_wire, numpy_dtype

_Kind = mc.ModelSequenceBatching.Control
START, READY, END, CORRID = (
    _Kind.CONTROL_SEQUENCE_START,
    _Kind.CONTROL_SEQUENCE_READY,
    _Kind.CONTROL_SEQUENCE_END,
    _Kind.CONTROL_SEQUENCE_CORRID,
)
_U64 = (1 << 64) - 1
_CORRID_TYPES = (mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32, mc.TYPE_STRING)


def correlation_key(cid) -> int | tuple | None:
    """Hashable sequence key: an int for a uint64 ID, ('s', text) for a string ID; None when absent."""
    if isinstance(cid, bool) or cid is None:
        return None
    if isinstance(cid, int):
        value = cid & _U64  # an int64 on the wire names the same uint64
        return value or None
    if isinstance(cid, bytes):
        cid = cid.decode("utf-8", "replace")
    if isinstance(cid, str):
        return ("s", cid) if cid else None
    return None


def display_key(key) -> str:
    return key[1] if isinstance(key, tuple) else str(key)


@dataclass
class Control:
    """One configured control tensor: its name, kind, wire datatype and the values for false and true."""

    name: str
    kind: int
    datatype: str  # wire datatype
    false: object = None
    true: object = None


def parse_controls(config: mc.ModelConfig) -> list[Control]:
    """Validate `control_input` as Triton does and return one Control per configured control."""
    name = config.name
    seen_tensors: set[str] = set()
    seen_kinds: set[int] = set()
    out: list[Control] = []
    for ci in config.sequence_batching.control_input:
        if not ci.name:
            raise InvalidArgument(f"sequence batching control tensor must have a name for {name}")
        if ci.name in seen_tensors:
            raise InvalidArgument(
                f"sequence batching control tensor '{ci.name}' is specified for multiple "
                f"control kinds for {name}"
            )
        seen_tensors.add(ci.name)
        for c in ci.control:
            kind = _Kind.Kind.Name(c.kind)
            if c.kind in seen_kinds:
                raise InvalidArgument(f"sequence batching specifies multiple {kind} tensors for {name}")
            seen_kinds.add(c.kind)
            found = [
                (field, list(values))
                for field, values in (
                    ("int32_false_true", c.int32_false_true),
                    ("fp32_false_true", c.fp32_false_true),
                    ("bool_false_true", c.bool_false_true),
                )
                if len(values)
            ]
            if c.kind == CORRID:
                if found:
                    raise InvalidArgument(
                        "sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or "
                        f"'bool_false_true' for {kind} for {name}"
                    )
                if c.data_type not in _CORRID_TYPES:
                    raise InvalidArgument(
                        "unexpected control data type, expected TYPE_UINT64, TYPE_INT64, TYPE_UINT32, "
                        f"TYPE_INT32, or TYPE_STRING for {kind} for {name}"
                    )
                out.append(Control(ci.name, c.kind, config_to_wire(data_type_name(c.data_type))))
                continue
            if not found:
                raise InvalidArgument(
                    "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or "
                    f"'bool_false_true' for {kind} for {name}"
                )
            if len(found) > 1:
                raise InvalidArgument(
                    "sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' "
                    f"and 'bool_false_true' for {kind} for {name}"
                )
            field, values = found[0]
            if len(values) != 2:
                raise InvalidArgument(
                    f"sequence batching control '{field}' must have exactly 2 entries for {kind} for {name}"
                )
            datatype = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}[
                field
            ]
            out.append(Control(ci.name, c.kind, datatype, values[0], values[1]))
    return out


def corrid_array(key, datatype: str, shape: tuple) -> np.ndarray:
    if datatype == "BYTES":
        arr = np.empty(shape, dtype=np.object_)
        arr[...] = display_key(key).encode("utf-8")
        return arr
    dtype = numpy_dtype(datatype)
    if isinstance(key, tuple):  # a string ID in a numeric control: its number if it is one, else 0
        text = key[1]
        value = int(text) if text.isdigit() else 0
    else:
        value = key
    return np.full(shape, value, dtype=np.uint64).astype(dtype)  # wraps as a C cast would
