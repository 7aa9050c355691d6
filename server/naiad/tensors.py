"""Tensor datatypes (KServe "FP32", config "TYPE_FP32", numpy) and the BYTES wire encoding."""

from __future__ import annotations

import struct

import numpy as np

from .errors import InvalidArgument

# KServe v2 datatype -> numpy dtype. BF16 has no numpy dtype: it travels as raw uint16 words.
_NUMPY = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
    "BF16": np.dtype(np.uint16),
}
DATATYPES = frozenset(_NUMPY)

_FROM_NUMPY = {dt: name for name, dt in _NUMPY.items() if name != "BF16"}
_FROM_NUMPY[np.dtype(np.bytes_)] = "BYTES"
_FROM_NUMPY[np.dtype(np.str_)] = "BYTES"

# Config enums (model_config.proto DataType) and their KServe names.
_CONFIG_TO_WIRE = {f"TYPE_{n}": n for n in _NUMPY if n != "BYTES"}
_CONFIG_TO_WIRE["TYPE_STRING"] = "BYTES"
_WIRE_TO_CONFIG = {v: k for k, v in _CONFIG_TO_WIRE.items()}

ITEMSIZE = {name: dt.itemsize for name, dt in _NUMPY.items() if name != "BYTES"}


def config_to_wire(config_type: str) -> str:
    """'TYPE_FP32' -> 'FP32'; 'TYPE_STRING' -> 'BYTES'."""
    try:
        return _CONFIG_TO_WIRE[config_type]
    except KeyError:
        raise InvalidArgument(f"unknown data type '{config_type}'") from None


def wire_to_config(datatype: str) -> str:
    """'FP32' -> 'TYPE_FP32'; 'BYTES' -> 'TYPE_STRING'."""
    try:
        return _WIRE_TO_CONFIG[datatype]
    except KeyError:
        raise InvalidArgument(f"unknown datatype '{datatype}'") from None


def numpy_dtype(datatype: str) -> np.dtype:
    try:
        return _NUMPY[datatype]
    except KeyError:
        raise InvalidArgument(f"invalid datatype '{datatype}'") from None


def datatype_of(array: np.ndarray, hint: str | None = None) -> str:
    """The KServe datatype of a numpy array; `hint` ('BF16') disambiguates uint16 words."""
    if hint == "BF16" and array.dtype == np.uint16:
        return "BF16"
    dt = array.dtype
    name = _FROM_NUMPY.get(dt)
    if name is None:
        if dt.kind in ("S", "U", "O"):
            return "BYTES"
        raise InvalidArgument(f"unsupported numpy dtype {dt}")
    return name


def element_count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- BYTES: each element is a 4-byte little-endian length followed by the bytes ----


def serialize_bytes(array: np.ndarray) -> bytes:
    """Flatten a BYTES tensor (object/bytes/str array) into Triton's length-prefixed wire form."""
    parts = []
    pack = struct.Struct("<I").pack
    for item in array.reshape(-1):
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, (bytes, bytearray, memoryview)):
            item = str(item).encode("utf-8")
        parts.append(pack(len(item)))
        parts.append(bytes(item))
    return b"".join(parts)


def deserialize_bytes(buf, count: int | None = None) -> np.ndarray:
    """Parse length-prefixed BYTES elements into a 1-D object array of `bytes`."""
    view = memoryview(buf)
    out = []
    off = 0
    end = len(view)
    while off < end:
        if off + 4 > end:
            raise InvalidArgument("BYTES tensor data is truncated: incomplete 4-byte length prefix")
        (n,) = struct.unpack_from("<I", view, off)
        off += 4
        if off + n > end:
            raise InvalidArgument(f"BYTES tensor element of length {n} runs past the end of the data")
        out.append(bytes(view[off : off + n]))
        off += n
    if count is not None and len(out) != count:
        raise InvalidArgument(f"expected {count} BYTES elements, got {len(out)}")
    arr = np.empty(len(out), dtype=np.object_)
    arr[:] = out
    return arr


class ByteSizeMismatch(InvalidArgument):
    """A tensor's bytes are not what its datatype and shape make; `expected` and `got` in bytes (a frontend that
    knows the input's name, the model and the request id says so in Triton's words: `byte_size_mismatch`)."""

    def __init__(self, expected: int, got: int, datatype: str, shape):
        super().__init__(
            f"unexpected total byte size {got} for input, expecting {expected} "
            f"({expected // max(1, ITEMSIZE.get(datatype, 1))} {datatype} elements of shape {list(shape)})"
        )
        self.expected = expected
        self.got = got


def byte_size_mismatch(name: str, model: str, request_id: str, expected: int, got: int) -> InvalidArgument:
    """Triton's words for an input whose bytes (or typed values) do not match its shape."""
    return InvalidArgument(
        f"[request id: {request_id or '<id_unknown>'}] input byte size mismatch for input '{name}' for model "
        f"'{model}'. Expected {expected}, got {got}"
    )


def from_buffer(datatype: str, buf, shape) -> np.ndarray:
    """A numpy view (no copy) of fixed-size tensor bytes; BYTES are parsed."""
    count = element_count(shape)
    if datatype == "BYTES":
        return deserialize_bytes(buf, count).reshape(shape)
    dt = numpy_dtype(datatype)
    expected = count * dt.itemsize
    if len(buf) != expected:
        raise ByteSizeMismatch(expected, len(buf), datatype, shape)
    return np.frombuffer(buf, dtype=dt).reshape(shape)


def to_bytes(array: np.ndarray, datatype: str):
    """Wire bytes of a tensor: a zero-copy memoryview for contiguous fixed-size data."""
    if datatype == "BYTES":
        return serialize_bytes(array)
    if array.size == 0:
        return b""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.data.cast("B")


def from_json_data(datatype: str, data, shape) -> np.ndarray:
    """Build a tensor from JSON `data` (flat or nested lists) and check it against `shape`."""
    if datatype in ("FP16", "BF16"):
        if datatype == "BF16":
            raise InvalidArgument("BF16 tensors can only be sent with the binary tensor data extension")
    count = element_count(shape)
    if datatype == "BYTES":
        flat = _flatten(data)
        if len(flat) != count:
            raise _count_mismatch(len(flat), count, shape)
        arr = np.empty(count, dtype=np.object_)
        for i, v in enumerate(flat):
            if isinstance(v, str):
                arr[i] = v.encode("utf-8")
            elif isinstance(v, (bytes, bytearray)):
                arr[i] = bytes(v)
            else:
                raise InvalidArgument(f"BYTES tensor data must be strings, got {type(v).__name__}")
        return arr.reshape(shape)
    dt = numpy_dtype(datatype)
    try:
        try:
            raw = np.asarray(data)
        except ValueError:
            # ragged nesting ([[1, 2], [3]]): Triton reads the values in order, whatever the nesting
            raw = np.asarray(_flatten(data, nested=True))
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidArgument(f"unable to parse 'data' as {datatype}: {exc}") from None
    if raw.size != count:
        raise _count_mismatch(raw.size, count, shape)
    if count == 0:
        return np.empty(shape, dtype=dt)
    kind = raw.dtype.kind
    if kind in "fO" and dt.kind in "iu":
        exact = _exact_integers(data, dt, datatype)
        if exact is not None:
            return exact.reshape(shape)
    if datatype == "BOOL":
        if kind != "b":
            raise InvalidArgument("unable to parse 'data': BOOL tensor data must be true/false")
    elif kind not in ("i", "u", "f") or (kind == "f" and dt.kind in "iu") or _has_bool(data, raw):
        # (an integer past 2**64 reaches here as a float: the JSON parser holds at most 64 bits)
        expected = f"integers within the range of {datatype}" if dt.kind in "iu" else "numbers"
        raise InvalidArgument(f"unable to parse 'data': {datatype} tensor data must be JSON {expected}")
    try:
        arr = raw.astype(dt, copy=False) if raw.dtype != dt else raw
    except (ValueError, OverflowError) as exc:
        raise InvalidArgument(f"unable to parse 'data' as {datatype}: {exc}") from None
    if kind in "iu" and dt.kind in "iu" and (raw.min() < np.iinfo(dt).min or raw.max() > np.iinfo(dt).max):
        raise InvalidArgument(f"unable to parse 'data': value out of range for {datatype}")
    return arr.reshape(shape)


def to_json_data(array: np.ndarray, datatype: str) -> list:
    """Flat list for the JSON `data` field."""
    if datatype == "BYTES":
        out = []
        for v in array.reshape(-1):
            if isinstance(v, (bytes, bytearray)):
                try:
                    out.append(bytes(v).decode("utf-8"))
                except UnicodeDecodeError:
                    raise InvalidArgument(
                        "BYTES output is not valid UTF-8; request it with binary_data: true"
                    ) from None
            else:
                out.append(str(v))
        return out
    if datatype == "BF16":
        raise InvalidArgument("BF16 outputs can only be returned with the binary tensor data extension")
    return array.reshape(-1).tolist()


def _exact_integers(data, dt: np.dtype, datatype: str) -> np.ndarray | None:
    """JSON integers numpy could only hold as float64 (values past 2**63 next to small ones), kept exact."""
    flat = _flatten(data)
    if not all(type(v) is int for v in flat):
        return None
    info = np.iinfo(dt)
    if min(flat) < info.min or max(flat) > info.max:
        raise InvalidArgument(f"unable to parse 'data': value out of range for {datatype}")
    return np.array(flat, dtype=dt)


def _count_mismatch(got: int, expected: int, shape) -> InvalidArgument:
    return InvalidArgument(
        f"unexpected number of elements {got} in 'data', expecting {expected} for shape {list(shape)}"
    )


def _flatten(data, nested: bool = False) -> list:
    """The values of (nested) lists in order; a list whose first value is not a list is taken as flat unless
    `nested` says it may hold lists further on."""
    if not isinstance(data, list):
        return [data]
    if not data or (not nested and not isinstance(data[0], list)):
        return data
    out: list = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def _has_bool(data, raw: np.ndarray) -> bool:
    """numpy folds true/false into numbers; a JSON number tensor must not contain them."""
    if raw.dtype.kind not in "iu" or raw.size == 0:
        return False
    return any(v is True or v is False for v in _flatten(data))
