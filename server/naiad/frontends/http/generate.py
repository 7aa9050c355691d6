"""Triton's generate extension: flat JSON in, flat JSON out (`/generate`), or Server-Sent Events (`/generate_stream`).

As Triton's `extension_generate.md` and its HTTP server define it: each top-level key (and each key inside
`parameters`) that names a model input becomes that input, typed by the model config and shaped to its dims (fixed
dims take their share of the elements, the innermost variable dim the rest); any other key becomes a request
parameter (a string, integer, boolean or number). Each response output, and each response parameter, becomes a
top-level key: one element as a scalar, otherwise a list.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ... import tensors
from ...errors import InvalidArgument
from ...inference import InferenceRequest, InferenceResponse
from ..triton.parameters import request_options

EXACTLY_ONE = (
    "generate expects model to produce exactly 1 response, use generate stream for model that generates various "
    "number of responses"
)


class _Pairs(list):
    """A JSON object as its (key, value) pairs in order, so that a key given twice is seen."""


def parse(body: bytes) -> _Pairs:
    if not body:
        return _Pairs()
    try:
        doc = json.loads(body, object_pairs_hook=_Pairs)
    except ValueError as exc:
        raise InvalidArgument(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(doc, _Pairs):
        raise InvalidArgument("the generate request body must be a JSON object")
    return doc


def fit_shape(name: str, dims: list[int], count: int) -> list[int]:
    """Triton's two passes from an element count to a tensor shape: every fixed dim takes its share, the innermost
    variable dim takes what remains, other variable dims are 1."""
    shape = list(dims)
    remaining = count
    for d in reversed(shape):
        if d != -1:
            if d == 0 or remaining % d:
                raise InvalidArgument(
                    f"The schema can not convert input '{name}' to tensor with proper shape"
                )
            remaining //= d
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == -1:
            shape[i] = remaining
            remaining = 1
    if remaining != 1 and count != 0:
        raise InvalidArgument(f"The schema can not convert input '{name}' to tensor with proper shape")
    return shape


def _check_types(name: str, datatype: str, values: list) -> None:
    """Triton's wording for a JSON value of the wrong kind."""
    for v in values:
        if isinstance(v, list):
            _check_types(name, datatype, v)
        elif datatype == "BYTES" and not isinstance(v, str):
            raise InvalidArgument(f"attempt to access JSON non-string as string (input '{name}')")
        elif datatype == "BOOL" and not isinstance(v, bool):
            raise InvalidArgument(f"attempt to access JSON non-boolean as boolean (input '{name}')")
        elif datatype not in ("BYTES", "BOOL") and (isinstance(v, (bool, str, _Pairs)) or v is None):
            raise InvalidArgument(f"attempt to access JSON non-number as number (input '{name}')")


def _parameter(name: str, value: Any) -> Any:
    if isinstance(value, (str, bool, int, float)):
        return value
    raise InvalidArgument(
        f"parameter '{name}' has invalid type. It should be either 'int', 'bool', or 'string'."
    )


def decode(mv, body: _Pairs | dict, version: int) -> InferenceRequest:
    """A generate request body (see `parse`) as an inference request for model version `mv`."""
    pairs = list(body.items()) if isinstance(body, dict) else list(body)
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    params: dict[str, Any] = {}
    req_id = ""

    def take(key: str, value: Any) -> None:
        spec = mv.inputs.get(key)
        if spec is None:
            params[key] = _parameter(key, value)
            return
        if key in inputs:
            raise InvalidArgument(f"input '{key}' already exists in request")
        values = value if isinstance(value, list) else [value]
        _check_types(key, spec.datatype, values)
        flat = _flatten(values)
        dims = ([-1] if mv.max_batch_size > 0 else []) + list(spec.dims)
        shape = fit_shape(key, dims, len(flat))
        inputs[key] = tensors.from_json_data(spec.datatype, flat, shape)
        datatypes[key] = spec.datatype

    for key, value in pairs:
        if key == "parameters" and "parameters" not in mv.inputs:
            if not isinstance(value, _Pairs | dict):
                raise InvalidArgument("Expected JSON object for keyword: 'parameters'")
            nested = list(value.items()) if isinstance(value, dict) else list(value)
            for k, v in nested:
                try:
                    take(k, v)
                except InvalidArgument as exc:
                    raise InvalidArgument(f"Converting keyword: 'parameters': {exc.message}") from None
        elif key == "id" and "id" not in mv.inputs:
            if not isinstance(value, str):
                raise InvalidArgument("the generate request's 'id' must be a string")
            req_id = value
        else:
            take(key, value)
    request = InferenceRequest(
        model_name=mv.name,
        inputs=inputs,
        datatypes=datatypes,
        model_version=version,
        id=req_id,
        parameters=params,
    )
    request_options(request, params, strict=False)
    return request


def _flatten(values: list) -> list:
    out: list = []
    for v in values:
        if isinstance(v, list):
            out.extend(_flatten(v))
        else:
            out.append(v)
    return out


def encode(resp: InferenceResponse) -> dict:
    out: dict = {"model_name": resp.model_name, "model_version": resp.model_version}
    if resp.id:
        out["id"] = resp.id
    for key, value in (resp.parameters or {}).items():
        if isinstance(value, (str, bool, int, float)) and not key.startswith("triton_"):
            out[key] = value
    for t in resp.outputs:
        values = (
            tensors.to_json_data(t.data, t.datatype)
            if t.datatype in ("BYTES", "BF16")
            else np.asarray(t.data).reshape(-1).tolist()
        )
        out[t.name] = values[0] if len(values) == 1 else values
    return out
