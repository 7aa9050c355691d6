"""Triton's generate extension: flat JSON in, flat JSON out (`/generate`), or Server-Sent Events (`/generate_stream`).

A request body `{"text_input": "hi", "max_tokens": 8, "parameters": {...}}` maps each key that names a model
input to that input (typed by the model config; a scalar becomes shape [1], a list its length, with a batch
dimension of 1 when the model batches); `parameters` become request parameters. Each response output becomes a
key: one element as a scalar, several as a list.
"""

from __future__ import annotations

import numpy as np

from .. import tensors
from ..errors import InvalidArgument
from ..inference import InferenceRequest, InferenceResponse
from .common import request_options


def decode(mv, body: dict, version: int) -> InferenceRequest:
    if not isinstance(body, dict):
        raise InvalidArgument("the generate request body must be a JSON object")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidArgument("'parameters' must be a JSON object")
    inputs, datatypes = {}, {}
    for key, value in body.items():
        if key in ("parameters", "id"):
            continue
        spec = mv.inputs.get(key)
        if spec is None:
            raise InvalidArgument(
                f"generate request for model '{mv.name}' has unexpected key '{key}' "
                f"(model inputs: {', '.join(mv.inputs) or 'none'})"
            )
        values = value if isinstance(value, list) else [value]
        shape = [len(values)]
        if mv.max_batch_size > 0:
            shape = [1] + shape
        inputs[key] = tensors.from_json_data(spec.datatype, values, shape)
        datatypes[key] = spec.datatype
    req_id = body.get("id", "")
    request = InferenceRequest(
        model_name=mv.name,
        inputs=inputs,
        datatypes=datatypes,
        model_version=version,
        id=str(req_id),
        parameters=params,
    )
    request_options(request, params)
    return request


def encode(resp: InferenceResponse) -> dict:
    out: dict = {"model_name": resp.model_name, "model_version": resp.model_version}
    if resp.id:
        out["id"] = resp.id
    for t in resp.outputs:
        values = (
            tensors.to_json_data(t.data, t.datatype)
            if t.datatype in ("BYTES", "BF16")
            else np.asarray(t.data).reshape(-1).tolist()
        )
        out[t.name] = values[0] if len(values) == 1 else values
    return out
