"""The HTTP/REST data plane both HTTP transports share (the aiohttp app and the HTTP/1.1 fast path): infer request
decoding, response encoding, error payloads, restricted-API messages and body (de)compression."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from ... import tensors
from ...errors import InvalidArgument, NotFound, as_naiad_error
from ...inference import InferenceRequest, InferenceResponse, RequestedOutput
from ...orchestration.on_demand import LOAD_WAIT_HEADER
from ...version_string import parse_version
from ..transport.receive_buffers import POOL, POOLED_MIN
from ..triton.parameters import boolean, parameters_of, request_options, unsigned

HEADER_LENGTH = "Inference-Header-Content-Length"
_NUMPY_OPT = orjson.OPT_SERIALIZE_NUMPY


def error_payload(exc: BaseException) -> tuple[int, bytes]:
    """(HTTP status, JSON body) of an error, for the aiohttp app and the fast path alike."""
    err = as_naiad_error(exc)
    return err.http_status, orjson.dumps({"error": err.message})


def error_headers(exc: BaseException) -> dict | None:
    """Extra response headers of an error: `Retry-After` when it says when to come back."""
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is None:
        return None
    return {"Content-Type": "application/json", "Retry-After": str(max(1, round(retry_after)))}


def load_wait_header(request: InferenceRequest, headers: dict) -> None:
    """Say on the response of a request that waited for its model to load on demand how long it waited."""
    headers[LOAD_WAIT_HEADER] = f"{request.load_wait_ns / 1e6:.1f}"


def restricted_message(key: str) -> str:
    return f"This API is restricted, expecting header '{key}'"


# ---- request decoding ----


def _request_id(doc: dict) -> str:
    """The request's id as Triton's messages print it."""
    rid = doc.get("id")
    return rid if isinstance(rid, str) and rid else "<id_unknown>"


def decode_infer_request(
    model: str, version: str, body: bytes | memoryview, header_length: str | None, shm=None
) -> tuple[InferenceRequest, bool]:
    """Parse a KServe v2 JSON (+ binary) request; tensors are views over `body` wherever possible."""
    json_part: bytes | memoryview
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise InvalidArgument(f"invalid {HEADER_LENGTH} header '{header_length}'") from None
        if n < 0 or n > len(body):
            raise InvalidArgument(
                f"{HEADER_LENGTH} header value {n} is larger than the request body ({len(body)} bytes)"
            )
        json_part = memoryview(body)[:n]
        binary = memoryview(body)[n:]
    else:
        json_part, binary = body, memoryview(b"")
    try:
        doc = orjson.loads(json_part)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("the request body must be a JSON object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list):
        raise InvalidArgument("request JSON must contain an 'inputs' array")
    params = parameters_of(doc)
    inputs: dict[str, np.ndarray] = {}
    device = False
    datatypes: dict[str, str] = {}
    offset = 0
    for item in raw_inputs:
        if not isinstance(item, dict):
            raise InvalidArgument("each entry of 'inputs' must be a JSON object")
        name = item.get("name")
        datatype = item.get("datatype")
        shape = item.get("shape")
        if not isinstance(name, str):
            raise InvalidArgument("input is missing 'name'")
        if not isinstance(datatype, str):
            raise InvalidArgument(f"input '{name}' is missing 'datatype'")
        if datatype not in tensors.DATATYPES:
            raise InvalidArgument(f"input '{name}' has invalid datatype '{datatype}'")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise InvalidArgument(f"input '{name}' must have a 'shape' of non-negative integers")
        if name in inputs:
            raise InvalidArgument(
                f"[request id: {_request_id(doc)}] input '{name}' already exists in request"
            )
        iparams = parameters_of(item, "input", name)
        if (
            iparams
            and ("data" in item) + ("binary_data_size" in iparams) + ("shared_memory_region" in iparams) > 1
        ):
            given = [f for f in ("binary_data_size", "shared_memory_region") if f in iparams]
            raise InvalidArgument(
                "Input must set only one of the following fields: 'data', 'binary_data_size' in "
                "'parameters', 'shared_memory_region' in 'parameters'. But set "
                + " ".join(f"'{f}'" for f in (["data"] if "data" in item else []) + given)
            )
        if "shared_memory_region" in iparams:
            if shm is None:
                raise InvalidArgument("shared memory is not enabled on this server")
            inputs[name] = shm.read_input(name, datatype, shape, iparams)
            device = device or not isinstance(inputs[name], np.ndarray)  # a CUDA shared-memory span
        elif "binary_data_size" in iparams:
            size = iparams["binary_data_size"]
            if not isinstance(size, int) or size < 0:
                raise InvalidArgument(f"input '{name}': 'binary_data_size' must be a non-negative integer")
            if offset + size > len(binary):
                raise InvalidArgument(
                    f"unexpected end of binary data for input '{name}': needs {size} bytes at offset "
                    f"{offset}, but only {len(binary) - offset} remain"
                )
            try:
                inputs[name] = tensors.from_buffer(datatype, binary[offset : offset + size], shape)
            except tensors.ByteSizeMismatch as exc:
                raise tensors.byte_size_mismatch(
                    name, model, _request_id(doc), exc.expected, exc.got
                ) from None
            offset += size
        elif "data" in item:
            data = item["data"]
            if type(data) is not list:
                raise InvalidArgument("Unable to parse 'data': attempt to access JSON non-array as array")
            inputs[name] = tensors.from_json_data(datatype, data, shape)
        else:
            raise InvalidArgument(f"input '{name}' has neither 'data' nor binary data")
        datatypes[name] = datatype
    if offset != len(binary):
        raise InvalidArgument(
            f"binary data is {len(binary)} bytes but the inputs' binary_data_size add up to {offset}"
        )
    default_binary = (
        boolean(params["binary_data_output"], "binary_data_output")
        if "binary_data_output" in params
        else False
    )
    outputs = []
    raw_outputs = doc.get("outputs") or []
    if not isinstance(raw_outputs, list):
        raise InvalidArgument("'outputs' must be an array")
    for item in raw_outputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidArgument("each entry of 'outputs' must be an object with a 'name'")
        oparams = parameters_of(item, "output", item["name"])
        binary_data = oparams.get("binary_data")
        if type(binary_data) is not bool and "binary_data" in oparams:
            boolean(binary_data, "binary_data")  # (raises: only true and false are binary_data)
        classification = oparams.get("classification", 0)
        if type(classification) is not int or classification < 0:
            unsigned(classification, "classification", "set")  # (raises: a count is an unsigned integer)
        outputs.append(RequestedOutput(item["name"], binary_data, classification, oparams))
    req_id = doc.get("id", "")
    if not isinstance(req_id, str):
        raise InvalidArgument("Unable to parse 'id': attempt to access JSON non-string as string")
    request = InferenceRequest(
        model_name=model,
        inputs=inputs,
        datatypes=datatypes,
        model_version=model_version(version),
        id=req_id,
        outputs=outputs,
        device_inputs=device,
        parameters=params,
    )
    request_options(request, params)
    return request, default_binary


def model_version(version: str) -> int:
    """Triton's routes only match ASCII-digit versions (anything else is a 404); those parse as its gRPC ones do."""
    if not version:
        return -1
    if not (version.isascii() and version.isdigit()):
        raise NotFound(f"Not Found: model version '{version}' must be a non-negative integer")
    return parse_version(version)


def encode_infer_response(
    response: InferenceResponse, request: InferenceRequest, default_binary: bool, shm=None
) -> tuple[list, dict]:
    """(body chunks, headers). Binary outputs follow the JSON header, as the binary extension defines."""
    wanted = {o.name: o for o in request.outputs}
    outputs = []
    chunks = []
    for out in response.outputs:
        req = wanted.get(out.name)
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": out.shape}
        oparams = req.parameters if req is not None else {}
        if req is not None and "shared_memory_region" in oparams:
            if shm is None:
                raise InvalidArgument("shared memory is not enabled on this server")
            shm.write_output(out, oparams)  # Triton's entry then has no `parameters` (nor `data`)
        # binary_data_output reaches only the outputs of a request that lists none: as Triton does, a listed output
        # is JSON unless it asks for binary data itself
        elif default_binary if req is None else req.binary:
            data = tensors.to_bytes(out.data, out.datatype)
            entry["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            if out.datatype in ("BYTES", "BF16") or out.data.dtype.byteorder == ">":
                entry["data"] = tensors.to_json_data(out.data, out.datatype)
            else:
                entry["data"] = out.data.reshape(-1)
        outputs.append(entry)
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs
    head = orjson.dumps(doc, option=_NUMPY_OPT)
    if chunks:
        headers = {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"}
        return [head, *chunks], headers
    return [head], {"Content-Type": "application/json"}


# ---- body compression ----


def response_coding(accept: str) -> str | None:
    """The Content-Encoding an infer response gets for an Accept-Encoding value: gzip if accepted, else
    deflate (python `requests` sends both), else none."""
    return "gzip" if "gzip" in accept else ("deflate" if "deflate" in accept else None)


async def compress_response(loop, chunks: list, headers: dict, coding: str) -> tuple[list, dict]:
    """An infer response body compressed (zlib default level; deflate is the zlib format), for both HTTP
    paths; a large body is compressed off the event loop."""

    def run() -> bytes:
        c = zlib.compressobj(wbits=31 if coding == "gzip" else zlib.MAX_WBITS)
        return b"".join([*(c.compress(x) for x in chunks), c.flush()])

    size = sum(len(x) for x in chunks)
    data = run() if size < 65536 else await loop.run_in_executor(None, run)
    return [data], {**headers, "Content-Encoding": coding}


INLINE_INFLATE = 8192  # compressed request bodies up to this size are inflated on the event loop
_REQUEST_WBITS = {"gzip": 31, "x-gzip": 31, "deflate": zlib.MAX_WBITS}


def inflate_body(data: bytes, coding: str, limit: int) -> bytes:
    """A request body inflated to at most `limit` bytes (the input beyond that is never inflated)."""
    wbits = _REQUEST_WBITS[coding]
    for attempt in (wbits, -zlib.MAX_WBITS) if coding == "deflate" else (wbits,):
        d = zlib.decompressobj(attempt)
        try:
            out = d.decompress(data, limit + 1)
        except zlib.error as exc:
            if attempt != -zlib.MAX_WBITS and coding == "deflate":
                continue  # raw deflate, as some clients send it
            raise web.HTTPBadRequest(reason=f"cannot decode the {coding} request body: {exc}") from None
        if len(out) > limit or d.unconsumed_tail:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(out))
        return out
    raise web.HTTPBadRequest(reason=f"cannot decode the {coding} request body")


async def read_tensor_body(request, limit: int) -> bytes | memoryview:
    """An infer request's body for the aiohttp app (the requests the fast path hands it: an `Expect` behind an
    unanswered request, a traceparent, compressed bodies ...; all with NAIAD_HTTP_FAST=0): a large one that is not content-encoded is copied once, chunk by chunk as aiohttp's parser
    made them, into a pooled receive buffer (transport/receive_buffers.py) and returned as a read-only view of it, as the
    fast path's are, instead of being joined twice into freshly mapped pages; anything else as read_body."""
    coding = request.headers.get("Content-Encoding", "identity").strip().lower()
    expected = request.content_length
    if coding not in ("identity", "") or (expected is not None and expected < POOLED_MIN):
        return await read_body(request, limit)
    chunks, size = await _body_chunks(request, limit)
    if size < POOLED_MIN:
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    view = POOL.view(size)
    pos = 0
    for chunk in chunks:
        view[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return view.toreadonly()


async def read_body(request, limit: int) -> bytes:
    """The request body for the aiohttp app (which runs with auto_decompress off): at most `limit` bytes on
    the wire, and, when it is gzip or deflate encoded, at most `limit` bytes inflated, off the event loop
    when large. aiohttp's own decompression inflates a chunk at a time without such a bound."""
    coding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if coding not in ("identity", "") and coding not in _REQUEST_WBITS:
        raise web.HTTPUnsupportedMediaType(reason=f"unsupported Content-Encoding '{coding[:32]}'")
    chunks, _ = await _body_chunks(request, limit)
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if coding in ("identity", ""):
        return data
    if len(data) <= INLINE_INFLATE:
        return inflate_body(data, coding, limit)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_inflater(), inflate_body, data, coding, limit)


async def _body_chunks(request, limit: int) -> tuple[list[bytes], int]:
    """The body as aiohttp's parser cut it (no join), and its size; 413 past `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            return chunks, size
        size += len(chunk)
        if size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        chunks.append(chunk)


_INFLATER = None


def _inflater():
    """One thread for inflating request bodies: bombs are inflated one at a time, never side by side."""
    global _INFLATER
    if _INFLATER is None:
        from concurrent.futures import ThreadPoolExecutor

        _INFLATER = ThreadPoolExecutor(1, thread_name_prefix="naiad-http-inflate")
    return _INFLATER
