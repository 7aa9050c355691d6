"""KServe v2 gRPC messages to and from Naiad's request and response: ModelInferRequest -> InferenceRequest
(raw contents as numpy views), InferenceResponse -> ModelInferResponse (or wire.py's chunked response)."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ... import tensors
from ...errors import InvalidArgument
from ...inference import InferenceRequest, InferenceResponse, RequestedOutput
from ...version_string import parse_version
from ..triton.parameters import request_options
from . import wire

# the datatype Triton names for each typed field when it holds values for an input of another datatype
_FIELD_TYPES = {
    "bool_contents": "BOOL",
    "int_contents": "INT32",
    "int64_contents": "INT64",
    "uint_contents": "UINT32",
    "uint64_contents": "UINT64",
    "fp32_contents": "FP32",
    "fp64_contents": "FP64",
    "bytes_contents": "BYTES",
}
# InferTensorContents field per datatype
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# Typed contents whose packed wire form is the array itself (little-endian): a large FP32 or FP64 one is cut out of
# the message (wire.SplitInferRequest), else read from one serialization of the contents (one copy in C; bools
# as protobuf writes them, a byte of 0 or 1 each) instead of element by element through protobuf's list (a million
# FP32 values: 0.75 against 64 ms). The varint-encoded integer fields have no such form.
_PACKED: dict[str, np.dtype] = {
    "fp32_contents": np.dtype("<f4"),
    "fp64_contents": np.dtype("<f8"),
    "bool_contents": np.dtype("?"),
}
PACKED_MIN = 256  # elements; fewer go through the list, which then costs less than serializing
# The integer fields as protobuf's list holds them (its C values, at the field's width): read by `np.fromiter`
# (a million INT64 values: 41 against 63 ms for `np.asarray`, which asks each value its type first), then narrowed
# to the input's datatype. Triton casts a value outside an INT8/INT16/UINT8/UINT16 input's range silently (300 as
# INT8 is 44; docs/triton-behaviour.md); here it is an InvalidArgument, as it is in HTTP JSON `data`.
_LISTED: dict[str, np.dtype] = {
    "int_contents": np.dtype("<i4"),
    "int64_contents": np.dtype("<i8"),
    "uint_contents": np.dtype("<u4"),
    "uint64_contents": np.dtype("<u8"),
}


def param_value(p):
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def decode_request(req: pb.ModelInferRequest, shm=None, raw=None, packed=None) -> InferenceRequest:
    """ModelInferRequest -> InferenceRequest; raw contents become numpy views without copies (`raw`: the
    raw_input_contents when they were kept out of the parse, `packed`: large typed contents kept out of it, by
    input position; see wire.SplitInferRequest)."""
    if raw is None:
        raw = req.raw_input_contents
    n_raw = len(raw)
    used_raw = 0  # as Triton: the inputs not in shared memory take the raw entries in order
    device = False
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for i, t in enumerate(req.inputs):
        name, datatype, shape = t.name, t.datatype, list(t.shape)
        split = packed.get(i) if packed else None  # the values of its contents, cut out of the message
        if datatype not in tensors.DATATYPES:
            raise InvalidArgument(f"input '{name}' has invalid datatype '{datatype}'")
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"input '{name}' has a negative dimension in shape {shape}")
        if name in inputs:
            raise InvalidArgument(
                f"[request id: {req.id or '<id_unknown>'}] input '{name}' already exists in request"
            )
        tparams = {k: param_value(v) for k, v in t.parameters.items()} if t.parameters else {}
        if "shared_memory_region" in tparams:
            if split is not None or t.HasField("contents"):
                raise InvalidArgument(
                    f"unexpected 'content' provided when using shared memory for input tensor '{name}' for "
                    f"model '{req.model_name}'"
                )
            if shm is None:
                raise InvalidArgument("shared memory is not enabled on this server")
            inputs[name] = shm.read_input(name, datatype, shape, tparams)
            device = device or not isinstance(inputs[name], np.ndarray)  # a CUDA shared-memory span
        elif n_raw:
            if split is not None or t.HasField("contents"):
                raise InvalidArgument(
                    f"contents field must not be specified when using raw_input_contents for '{name}' for "
                    f"model '{req.model_name}'"
                )
            if used_raw == n_raw:
                raise InvalidArgument(
                    f"unable to find data for input tensor '{name}' for model '{req.model_name}' in request."
                )
            try:
                inputs[name] = tensors.from_buffer(datatype, raw[used_raw], shape)
            except tensors.ByteSizeMismatch as exc:
                raise tensors.byte_size_mismatch(
                    name, req.model_name, req.id, exc.expected, exc.got
                ) from None
            used_raw += 1
        else:
            inputs[name] = _contents_array(req, t, datatype, shape, split)
        datatypes[name] = datatype
    if used_raw != n_raw:
        raise InvalidArgument(
            f"expected {used_raw} raw_input_contents entries (one per input not in shared memory), got {n_raw}"
        )
    # (protobuf containers cost ~2 us to iterate even when empty: look before iterating)
    params = _request_params(req.parameters) if req.parameters else {}
    outputs = []
    for o in req.outputs if len(req.outputs) else ():
        oparams = {k: param_value(v) for k, v in o.parameters.items()} if o.parameters else {}
        classification = _classification(o.parameters["classification"]) if "classification" in oparams else 0
        outputs.append(
            RequestedOutput(o.name, binary=True, classification=classification, parameters=oparams)
        )
    request = InferenceRequest(
        model_name=req.model_name,
        inputs=inputs,
        datatypes=datatypes,
        model_version=parse_version(req.model_version),
        id=req.id,
        outputs=outputs,
        parameters=params,
        device_inputs=device,
    )
    request_options(request, params)
    return request


_UINT64 = (1 << 64) - 1


def _request_params(parameters) -> dict:
    """A request's parameters as values, with Triton's checks of the kinds of `priority` (int64 >= 0 or uint64),
    `timeout` (int64; a negative one, which Triton reads as unsigned, is no timeout), `sequence_id` (int64 or string)
    and `sequence_start`/`sequence_end` (bool)."""
    params = {k: param_value(v) for k, v in parameters.items()}
    if "priority" in params:
        kind = parameters["priority"].WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param"):
            raise InvalidArgument(
                "invalid value type for 'priority' parameter, expected int64_param or uint64_param."
            )
        if params["priority"] < 0:
            raise InvalidArgument("invalid value for 'priority', expected value >= 0.")
    if "timeout" in params:
        if parameters["timeout"].WhichOneof("parameter_choice") != "int64_param":
            raise InvalidArgument("invalid value type for 'timeout' parameter, expected int64_param.")
        params["timeout"] = max(0, params["timeout"])
    if "sequence_id" in params:
        if parameters["sequence_id"].WhichOneof("parameter_choice") not in ("int64_param", "string_param"):
            raise InvalidArgument(
                "invalid value type for 'sequence_id' parameter, expected int64_param or string_param."
            )
        if not isinstance(params["sequence_id"], str):
            params["sequence_id"] &= _UINT64  # (Triton's correlation id is unsigned: -1 is 2**64-1)
    for key in ("sequence_start", "sequence_end"):
        if key in params and parameters[key].WhichOneof("parameter_choice") != "bool_param":
            raise InvalidArgument(f"invalid value type for '{key}' parameter, expected bool_param.")
    return params


def _classification(p) -> int:
    """An output's `classification` parameter as Triton checks it: an int64 above 0."""
    if p.WhichOneof("parameter_choice") != "int64_param":
        raise InvalidArgument("invalid value type for 'classification' parameter, expected int64_param")
    if p.int64_param <= 0:
        raise InvalidArgument("invalid value for 'classification' parameter, expected >= 0")
    return p.int64_param


def _contents_array(req, t, datatype: str, shape: list, split) -> np.ndarray:
    """An input's typed contents (InferTensorContents) as an array of `shape`: from `split`, the datatype's packed
    field that the wire split cut out of the message (a view of the received bytes); else from the parsed message."""
    name = t.name
    field = _CONTENTS.get(datatype)
    if field is None:
        raise InvalidArgument(f"input '{name}': datatype {datatype} must be sent in raw_input_contents")
    count = tensors.element_count(shape)
    size = tensors.ITEMSIZE.get(datatype, 0)  # (Triton counts a typed value as the datatype's bytes)
    if split is not None:
        dtype = _PACKED[field]
        if len(split) != count * dtype.itemsize:
            n = len(split) // dtype.itemsize
            raise tensors.byte_size_mismatch(name, req.model_name, req.id, count * size, n * size)
        return np.frombuffer(split, dtype).reshape(shape)
    if t.HasField("contents"):
        for other, _ in t.contents.ListFields():  # the fields that hold values
            if other.name != field:
                raise InvalidArgument(
                    f"unexpected explicit tensor data for input tensor '{name}' for model '{req.model_name}' of "
                    f"type '{_FIELD_TYPES[other.name]}', expected datatype '{datatype}'"
                )
    elif count:
        raise InvalidArgument(
            f"unable to find data for input tensor '{name}' for model '{req.model_name}' in request."
        )
    values = getattr(t.contents, field)
    if len(values) != count:
        if datatype == "BYTES":
            raise InvalidArgument(
                f"unexpected number of elements {len(values)} in the contents of input '{name}', "
                f"expecting {count} for shape {shape}"
            )
        raise tensors.byte_size_mismatch(name, req.model_name, req.id, count * size, len(values) * size)
    arr: np.ndarray | None
    if datatype == "BYTES":
        arr = np.empty(count, dtype=np.object_)
        arr[:] = list(values)
    else:
        arr = _typed_array(t.contents, field, values, datatype, count)
        if arr is None:
            raise InvalidArgument(f"input '{name}': a value of {field} is out of range for {datatype}")
    return arr.reshape(shape)


def _typed_array(contents, field: str, values, datatype: str, count: int) -> np.ndarray | None:
    """Typed contents as an array (read-only when read from the packed field); None when an integer is outside
    the datatype's range."""
    listed = _LISTED.get(field)
    if listed is not None:
        arr = np.fromiter(values, listed, count)
        dtype = tensors.numpy_dtype(datatype)
        if dtype == listed:
            return arr
        info = np.iinfo(dtype)
        if count and (arr.min() < info.min or arr.max() > info.max):
            return None
        return arr.astype(dtype)
    packed = _PACKED.get(field)
    if packed is not None and count >= PACKED_MIN:
        view = wire.packed_field(contents.SerializeToString(), wire.CONTENTS_FIELDS[field])
        if view is not None and len(view) == count * packed.itemsize:
            return np.frombuffer(view, packed)
    return np.asarray(values, dtype=tensors.numpy_dtype(datatype))


def load_parameters(parameters) -> tuple[str | None, dict[str, bytes]]:
    """A RepositoryModelLoad's parameters as Triton checks them: `config` a string, `file:<path>` bytes, nothing
    else; (config or None, files)."""
    config = None
    files: dict[str, bytes] = {}
    for key, p in parameters.items():
        kind = p.WhichOneof("parameter_choice")
        if key == "config":
            if kind != "string_param":
                raise InvalidArgument(
                    "invalid value type for load parameter 'config', expected string_param."
                )
            config = p.string_param or None
        elif key.startswith("file:"):
            if kind != "bytes_param":
                raise InvalidArgument(f"invalid value type for load parameter '{key}', expected bytes_param.")
            files[key[len("file:") :]] = p.bytes_param
        else:
            raise InvalidArgument(f"unrecognized load parameter '{key}'.")
    return config, files


def unload_dependents(parameters) -> bool:
    """A RepositoryModelUnload's `unload_dependents`, a bool as Triton checks it."""
    if "unload_dependents" not in parameters:
        return False
    p = parameters["unload_dependents"]
    if p.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidArgument("invalid value type for 'unload_dependents' parameter, expected bool_param.")
    return p.bool_param


def _set_param(p, value) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def encode_response(
    resp: InferenceResponse, request: InferenceRequest | None, shm=None, chunked: bool = False
) -> pb.ModelInferResponse:
    """InferenceResponse -> ModelInferResponse; `chunked`: a wire.ChunkedResponse whose raw contents are
    the output tensors' own memory (server.py sends it without joining)."""
    out = pb.ModelInferResponse(model_name=resp.model_name, model_version=resp.model_version, id=resp.id)
    for k, v in resp.parameters.items():
        _set_param(out.parameters[k], v)
    wanted = {o.name: o for o in request.outputs} if request is not None else {}
    raws = []
    for t in resp.outputs:
        out.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        req = wanted.get(t.name)
        if req is not None and "shared_memory_region" in req.parameters:
            if shm is None:
                raise InvalidArgument("shared memory is not enabled on this server")
            shm.write_output(t, req.parameters)
            # Triton sends one raw_output_contents entry per output, an empty one for an output in shared
            # memory; C++ clients (perf_analyzer) index raw_output_contents by output position.
            raws.append(b"")
            continue
        raws.append(tensors.to_bytes(t.data, t.datatype))
    if chunked and sum(len(r) for r in raws) >= wire.SPLIT_MIN:
        return wire.ChunkedResponse(out, raws)
    if raws:
        out.raw_output_contents.extend(bytes(r) for r in raws)
    return out
