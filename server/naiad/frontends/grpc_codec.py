"""KServe v2 gRPC messages to and from Naiad's request and response: ModelInferRequest -> InferenceRequest
(raw contents as numpy views), InferenceResponse -> ModelInferResponse (or grpc_wire's chunked response)."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from .. import tensors
from ..errors import InvalidArgument
from ..inference import InferenceRequest, InferenceResponse, RequestedOutput
from ..version_string import parse_version
from . import grpc_wire
from .common import request_options

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


def param_value(p):
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def decode_request(req: pb.ModelInferRequest, shm=None, raw=None) -> InferenceRequest:
    """ModelInferRequest -> InferenceRequest; raw contents become numpy views without copies (`raw`: the
    raw_input_contents when they were kept out of the parse, see grpc_wire.SplitInferRequest)."""
    if raw is None:
        raw = req.raw_input_contents
    n_raw = len(raw)
    used_raw = 0  # as Triton: the inputs not in shared memory take the raw entries in order
    device = False
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for t in req.inputs:
        name, datatype, shape = t.name, t.datatype, list(t.shape)
        if datatype not in tensors.DATATYPES:
            raise InvalidArgument(f"input '{name}' has invalid datatype '{datatype}'")
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"input '{name}' has a negative dimension in shape {shape}")
        if name in inputs:
            raise InvalidArgument(f"input '{name}' is given more than once")
        tparams = {k: param_value(v) for k, v in t.parameters.items()} if t.parameters else {}
        if "shared_memory_region" in tparams:
            if t.HasField("contents"):
                raise InvalidArgument(
                    f"unexpected 'content' provided when using shared memory for input tensor '{name}' for "
                    f"model '{req.model_name}'"
                )
            if shm is None:
                raise InvalidArgument("shared memory is not enabled on this server")
            inputs[name] = shm.read_input(name, datatype, shape, tparams)
            device = device or not isinstance(inputs[name], np.ndarray)  # a CUDA shared-memory span
        elif n_raw:
            if t.HasField("contents"):
                raise InvalidArgument(
                    f"contents field must not be specified when using raw_input_contents for '{name}' for "
                    f"model '{req.model_name}'"
                )
            if used_raw == n_raw:
                raise InvalidArgument(
                    f"unable to find data for input tensor '{name}' for model '{req.model_name}' in request."
                )
            inputs[name] = tensors.from_buffer(datatype, raw[used_raw], shape)
            used_raw += 1
        else:
            field = _CONTENTS.get(datatype)
            if field is None:
                raise InvalidArgument(
                    f"input '{name}': datatype {datatype} must be sent in raw_input_contents"
                )
            values = getattr(t.contents, field)
            count = tensors.element_count(shape)
            if count and not t.HasField("contents"):
                raise InvalidArgument(
                    f"unable to find data for input tensor '{name}' for model '{req.model_name}' in request."
                )
            if len(values) != count:
                raise InvalidArgument(
                    f"unexpected number of elements {len(values)} in the contents of input '{name}', "
                    f"expecting {count} for shape {shape}"
                )
            if datatype == "BYTES":
                arr = np.empty(count, dtype=np.object_)
                arr[:] = list(values)
            else:
                arr = np.asarray(values, dtype=tensors.numpy_dtype(datatype))
            inputs[name] = arr.reshape(shape)
        datatypes[name] = datatype
    if used_raw != n_raw:
        raise InvalidArgument(
            f"expected {used_raw} raw_input_contents entries (one per input not in shared memory), got {n_raw}"
        )
    # (protobuf containers cost ~2 us to iterate even when empty: look before iterating)
    params = {k: param_value(v) for k, v in req.parameters.items()} if req.parameters else {}
    outputs = []
    for o in req.outputs if len(req.outputs) else ():
        oparams = {k: param_value(v) for k, v in o.parameters.items()} if o.parameters else {}
        outputs.append(
            RequestedOutput(
                o.name, binary=True, classification=int(oparams.get("classification", 0)), parameters=oparams
            )
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
    """InferenceResponse -> ModelInferResponse; `chunked`: a grpc_wire.ChunkedResponse whose raw contents are
    the output tensors' own memory (h2grpc sends it without joining)."""
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
    if chunked and sum(len(r) for r in raws) >= grpc_wire.SPLIT_MIN:
        return grpc_wire.ChunkedResponse(out, raws)
    if raws:
        out.raw_output_contents.extend(bytes(r) for r in raws)
    return out
