"""Naiad vs. a real Triton 2.51: the same requests to both servers, the answers compared.

Both servers run on the comparison repository ``tools/triton/models`` (``identity_fp32``,
``identity_batched``, ``add_sub``, ``identity_bytes`` and the deliberately ``broken`` model), one pair
per module; the real-client cases (issue 12: reshape, shared-memory outputs, CUDA shared memory without a GPU,
model control errors, ambiguous inputs) run on a second pair in explicit model-control mode on the repository of
``tests/client_models.py``. Triton is the oracle: wherever the two disagree and the difference is not listed in one of
the tables below (each entry with its reason), the test asserts Triton's behaviour, so it fails until
Naiad matches.

Run (the real Triton comes from the ``nvidia-pytriton`` wheel)::

    bash tools/triton/setup.sh && .venv/bin/python -m pytest -m triton tests/test_triton_compare.py

See docs/triton-comparison.md for what is compared and the latest result.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import NaiadProcess, free_ports
from triton_reference import TRITON_MODELS, triton_available, tritonserver

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(
        not triton_available(),
        reason="real Triton not installed (run `bash tools/triton/setup.sh` to install tritonserver 2.51 "
        "from the nvidia-pytriton wheel into .venv-triton)",
    ),
]

HEADER_LENGTH = "Inference-Header-Content-Length"

# --------------------------------------------------------------------------------------------------
# Tables of accepted differences. Everything NOT listed here must behave exactly like Triton.
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Deliberate:
    triton_http: int
    naiad_http: int
    reason: str
    triton_grpc: str = ""  # grpc.StatusCode names, where the gRPC codes differ too
    naiad_grpc: str = ""


#: Error cases where Naiad deliberately answers differently from Triton (HTTP status codes).
#: The test asserts BOTH sides, so the entry goes stale (and fails) if either server changes.
_PARSE = (
    "Naiad: a request body it cannot parse is a client error (400, as its other validation errors); "
    "Triton reports its JSON parser's failure as 500"
)
DELIBERATE_DIFFERENCES: dict[str, Deliberate] = {
    # The two the core team named (Triton's side is captured in docs/triton-behaviour.md, summary point 4):
    "malformed_json": Deliberate(500, 400, _PARSE + " ('failed to parse the request JSON buffer')"),
    "data_length_mismatch_json": Deliberate(
        500, 400, _PARSE + " ('Unable to parse 'data': Shape does not match true shape of 'data' field')"
    ),
    # The rest of the same class (Triton's other "Unable to parse ..." 500s, same summary point), added under
    # the same reason because Naiad's own tests (tests/test_http.py::test_bad_requests) expect 400 for them
    # too. If the team wants Triton's 500 here after all, delete these four entries.
    "no_inputs_key": Deliberate(500, 400, _PARSE + " ('Unable to parse 'inputs'')"),
    "input_without_shape": Deliberate(500, 400, _PARSE + " ('Unable to parse 'shape'')"),
    "negative_shape_dim": Deliberate(
        500, 400, _PARSE + " ('Unable to parse 'shape': ... non-unsigned-integer')"
    ),
    "data_element_wrong_json_type": Deliberate(
        500, 400, _PARSE + " ('Unable to parse 'data': attempt to access JSON non-number as double')"
    ),
    # Issue 12 (real clients), same class: Triton's JSON parser failures.
    "request_id_not_a_string": Deliberate(
        500, 400, _PARSE + " ('Unable to parse 'id': attempt to access JSON non-string as string', same text)"
    ),
    "uint64_past_max": Deliberate(500, 400, _PARSE + " ('attempt to access JSON non-unsigned-integer ...')"),
    "uint64_negative": Deliberate(500, 400, _PARSE + " ('attempt to access JSON non-unsigned-integer ...')"),
    # Model control: Triton answers every load that fails before the model is built with 500/INTERNAL "failed
    # to load '<m>', failed to poll from model repository". Naiad keeps the prefix clients match on, but the
    # request is the client's error (a 4xx by the project's guide) and the text says what was wrong.
    "load_invalid_json_config": Deliberate(
        500,
        400,
        "an override that is not JSON is the client's error; Naiad says what failed to parse after Triton's "
        "'failed to load '<model>', ' prefix",
        "INTERNAL",
        "INVALID_ARGUMENT",
    ),
    "load_file_name_too_long": Deliberate(
        500,
        400,
        "a `file:` override the file system cannot hold is the client's error; Naiad names the file",
        "INTERNAL",
        "INVALID_ARGUMENT",
    ),
    "load_unknown_model": Deliberate(
        500,
        400,
        "a name in no repository is the client's error; same text as Triton",
        "INTERNAL",
        "INVALID_ARGUMENT",
    ),
}

#: Model-config (GET /v2/models/<m>/config) top-level keys that only Triton prints, with the reason.
CONFIG_KEYS_ONLY_TRITON: dict[str, str] = {
    "optimization": "Triton's C++-core tuning block (priority, pinned memory, CUDA graphs, TensorRT accelerators);"
    " Naiad implements none of it and does not echo Triton's defaults",
}

#: Keys of model-config `input`/`output` entries that only Triton prints, with the reason.
CONFIG_IO_KEYS_ONLY_TRITON: dict[str, str] = {}

#: Model-config top-level keys that only Naiad prints, with the reason (none today).
CONFIG_KEYS_ONLY_NAIAD: dict[str, str] = {}

#: Model-config fields present on both sides whose VALUES are not compared, with the reason (none today:
#: `backend`/`platform`/`default_model_filename` happen to agree for python-backend models).
CONFIG_VALUES_NOT_COMPARED: dict[str, str] = {}

#: GET /v2 (and gRPC ServerMetadata) fields whose values differ on purpose.
SERVER_METADATA_VALUES_NOT_COMPARED: dict[str, str] = {
    "name": "Naiad names itself ('naiad'), Triton says 'triton'",
    "version": "Naiad reports its own version, Triton '2.51.0'",
}

#: Extensions Triton advertises and Naiad does not, with the reason.
EXTENSIONS_ONLY_TRITON: dict[str, str] = {
    "cuda_shared_memory": "Naiad refuses CUDA shared-memory registration (no CUDA IPC; server/naiad/frontends), "
    "so it does not advertise it; Triton advertises it even on a host without a GPU",
}

#: Metric families only Naiad exposes (on purpose).
NAIAD_ONLY_FAMILIES: dict[str, str] = {
    "nv_model_load_duration_secs": "model load time per model version, a gauge Naiad adds on purpose "
    "(server/naiad/metrics.py); Triton 2.51 does not print it",
    "nv_python_backend_stub_restart_count": "restarts of python worker processes that died, per instance "
    "(server/naiad/backends/python/process.py); Triton 2.51 does not restart a stub that died",
}


def naiad_only_family_ok(name: str) -> bool:
    """Naiad adds latency histograms `nv_inference_*_duration_seconds` (Triton only has `*_us` counters);
    prometheus_client prints each histogram's `<name>_created` timestamp as a gauge family of its own; families in
    Naiad's own `naiad_` namespace (models on demand: loads, evictions, memory) have no Triton counterpart."""
    if name in NAIAD_ONLY_FAMILIES or name.startswith("naiad_"):
        return True
    return name.endswith("_seconds") or name.endswith("_seconds_created")


#: Metric families only Triton exposes, with the reason Naiad does not (none accepted today).
TRITON_ONLY_FAMILIES: dict[str, str] = {
    "nv_pinned_memory_pool_total_bytes": "Triton allocates a 256 MiB pinned host pool even without a GPU; Naiad "
    "stages GPU inputs per backend and reports no pool it does not have",
    "nv_pinned_memory_pool_used_bytes": "as nv_pinned_memory_pool_total_bytes",
}

# --------------------------------------------------------------------------------------------------
# The two servers
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Endpoint:
    name: str
    http_url: str
    grpc_addr: str
    metrics_url: str
    stub: Any = None
    channel: Any = None


@dataclasses.dataclass
class Pair:
    triton: Endpoint
    naiad: Endpoint

    def both(self):
        return (self.triton, self.naiad)


@pytest.fixture(scope="module")
def servers():
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    hp, gp, mp = free_ports(3)
    with tritonserver(
        TRITON_MODELS, hp, gp, mp, ["--exit-on-error=false", "--strict-readiness=false"], timeout=90
    ) as t:
        naiad = NaiadProcess(TRITON_MODELS, "--strict-readiness", "false")
        naiad.start()
        try:
            pair = Pair(
                Endpoint("triton", t.http_url, t.grpc_url, t.metrics_url),
                Endpoint("naiad", naiad.url, naiad.grpc, f"http://{naiad.metrics}/metrics"),
            )
            for ep in pair.both():
                ep.channel = grpc.insecure_channel(ep.grpc_addr)
                grpc.channel_ready_future(ep.channel).result(timeout=30)
                ep.stub = service_pb2_grpc.GRPCInferenceServiceStub(ep.channel)
            yield pair
            for ep in pair.both():
                ep.channel.close()
        finally:
            naiad.stop()


# --------------------------------------------------------------------------------------------------
# Helpers: HTTP, gRPC, tensor canonicalisation
# --------------------------------------------------------------------------------------------------

NP_DTYPE = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64, "FP64": np.float64}


@dataclasses.dataclass
class HttpAnswer:
    status: int
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body)

    def describe(self) -> str:
        return f"HTTP {self.status} {self.body[:300]!r}"


def http(
    ep: Endpoint, method: str, path: str, body: bytes | dict | list | None = None, headers: dict | None = None
) -> HttpAnswer:
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    r = requests.request(method, ep.http_url + path, data=body, headers=headers or {}, timeout=30)
    return HttpAnswer(r.status_code, dict(r.headers), r.content)


@dataclasses.dataclass
class GrpcAnswer:
    code: Any  # grpc.StatusCode
    details: str
    response: Any

    def describe(self) -> str:
        return f"gRPC {self.code.name} {self.details!r}"


def grpc_call(ep: Endpoint, rpc: str, request) -> GrpcAnswer:
    import grpc

    try:
        resp = getattr(ep.stub, rpc)(request, timeout=30)
        return GrpcAnswer(grpc.StatusCode.OK, "", resp)
    except grpc.RpcError as exc:
        return GrpcAnswer(exc.code(), exc.details() or "", None)


def flatten(data) -> list:
    if isinstance(data, list):
        out = []
        for d in data:
            out.extend(flatten(d))
        return out
    return [data]


def split_bytes(buf: bytes) -> list[bytes]:
    """BYTES tensor wire format: uint32 little-endian length + bytes, per element."""
    out, i = [], 0
    while i < len(buf):
        (n,) = struct.unpack_from("<I", buf, i)
        out.append(bytes(buf[i + 4 : i + 4 + n]))
        i += 4 + n
    return out


def join_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def canon_json_values(datatype: str, data) -> Any:
    """Values from JSON `data`, canonical: float32 bit patterns for FP32 (so -0.0 != 0.0), bytes for BYTES."""
    flat = flatten(data)
    if datatype == "BYTES":
        return [s.encode() if isinstance(s, str) else bytes(s) for s in flat]
    return np.asarray(flat, dtype=NP_DTYPE[datatype]).tobytes()


def canon_raw_values(datatype: str, raw: bytes) -> Any:
    if datatype == "BYTES":
        return split_bytes(raw)
    return bytes(raw)


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple
    values: Any  # np.ndarray (numeric) or list[bytes]
    json: tuple | None = None  # what to write in JSON `data` when not just `values` (e.g. decimal literals)

    def raw(self) -> bytes:
        if self.datatype == "BYTES":
            return join_bytes(self.values)
        return np.ascontiguousarray(self.values).tobytes()

    def json_data(self):
        if self.json is not None:
            return list(self.json)
        if self.datatype == "BYTES":
            return [v.decode() for v in self.values]
        return [
            float(x) if self.datatype.startswith("FP") else int(x) for x in np.asarray(self.values).ravel()
        ]


def fp32(values, shape) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).reshape(shape)


@dataclasses.dataclass(frozen=True)
class InferCase:
    id: str
    model: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[str, ...] = ()  # requested outputs; empty = all
    request_id: str = ""
    version: str = ""


TRICKY = [0.1, 1e-7, 16777217.0, 3.4e38, -0.0, 1e-45, 123456.789, 2.0, 1.0, 2.5, -3.0, 65504.0]

INFER_CASES = [
    InferCase(
        "identity_fp32",
        "identity_fp32",
        (Tensor("INPUT0", "FP32", (2, 6), fp32(TRICKY, (2, 6)), json=tuple(TRICKY)),),
        request_id="cmp-42",
    ),
    InferCase(
        "identity_fp32_v1",
        "identity_fp32",
        (Tensor("INPUT0", "FP32", (1, 3), fp32([1, 2.5, 3], (1, 3))),),
        version="1",
    ),
    InferCase(
        "identity_batched",
        "identity_batched",
        (Tensor("INPUT0", "FP32", (3, 2), fp32([1, -2, 0.25, 4e-3, 5, 6], (3, 2))),),
    ),
    InferCase(
        "add_sub",
        "add_sub",
        (
            Tensor("INPUT0", "FP32", (16,), fp32(np.arange(16) * 0.1, (16,))),
            Tensor("INPUT1", "FP32", (16,), fp32(np.linspace(-1, 1, 16), (16,))),
        ),
        request_id="as-1",
    ),
    InferCase(
        "add_sub_output1_only",
        "add_sub",
        (
            Tensor("INPUT0", "FP32", (16,), fp32(np.arange(16), (16,))),
            Tensor("INPUT1", "FP32", (16,), fp32(np.ones(16) * 0.3, (16,))),
        ),
        outputs=("OUTPUT1",),
    ),
    InferCase(
        "identity_bytes",
        "identity_bytes",
        (Tensor("INPUT0", "BYTES", (3,), [b"abc", b"", "h\u00e9llo".encode()]),),
    ),
]

PROTOCOLS = ["http_json", "http_binary", "grpc_raw", "grpc_contents"]


def infer_path(model: str, version: str = "") -> str:
    return f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"


def build_http(case: InferCase, binary: bool) -> tuple[bytes, dict]:
    doc: dict = {}
    if case.request_id:
        doc["id"] = case.request_id
    inputs, chunks = [], []
    for t in case.inputs:
        entry: dict = {"name": t.name, "shape": list(t.shape), "datatype": t.datatype}
        if binary:
            raw = t.raw()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = t.json_data()
        inputs.append(entry)
    doc["inputs"] = inputs
    if case.outputs:
        doc["outputs"] = [{"name": o, "parameters": {"binary_data": binary}} for o in case.outputs]
    elif binary:
        doc["parameters"] = {"binary_data_output": True}
    head = json.dumps(doc).encode()
    if not binary:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(chunks), {HEADER_LENGTH: str(len(head))}


def build_grpc(case: InferCase, raw: bool):
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name=case.model, model_version=case.version, id=case.request_id)
    for t in case.inputs:
        inp = req.inputs.add(name=t.name, datatype=t.datatype, shape=list(t.shape))
        if raw:
            req.raw_input_contents.append(t.raw())
        elif t.datatype == "BYTES":
            inp.contents.bytes_contents.extend(t.values)
        else:
            inp.contents.fp32_contents.extend(np.asarray(t.values).ravel().tolist())
    for o in case.outputs:
        req.outputs.add(name=o)
    return req


def normalise_http_infer(ans: HttpAnswer) -> dict:
    """Status, content type, the JSON header's keys and fields, and canonical output values."""
    assert ans.status == 200, ans.describe()
    if HEADER_LENGTH in ans.headers:
        n = int(ans.headers[HEADER_LENGTH])
        head, rest = json.loads(ans.body[:n]), ans.body[n:]
    else:
        head, rest = json.loads(ans.body), b""
    outs, offset = [], 0
    for o in head.get("outputs", []):
        params = o.get("parameters") or {}
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            values = canon_raw_values(o["datatype"], rest[offset : offset + size])
            offset += size
        else:
            values = canon_json_values(o["datatype"], o.get("data"))
        outs.append(
            {
                "keys": sorted(o),
                "name": o["name"],
                "datatype": o["datatype"],
                "shape": o["shape"],
                "parameters": params,
                "values": values,
            }
        )
    return {
        "content_type": ans.headers.get("Content-Type", "").split(";")[0],
        "has_header_length": HEADER_LENGTH in ans.headers,
        "keys": sorted(head),
        "id": head.get("id"),
        "model_name": head.get("model_name"),
        "model_version": head.get("model_version"),
        "outputs": outs,
        "trailing_bytes": len(rest) - offset,
    }


def normalise_grpc_infer(ans: GrpcAnswer) -> dict:
    assert ans.code.name == "OK", ans.describe()
    r = ans.response
    outs = []
    for i, o in enumerate(r.outputs):
        raw = r.raw_output_contents[i] if i < len(r.raw_output_contents) else None
        outs.append(
            {
                "name": o.name,
                "datatype": o.datatype,
                "shape": list(o.shape),
                "parameters": sorted(o.parameters),
                "typed_contents": o.HasField("contents"),
                "values": None if raw is None else canon_raw_values(o.datatype, raw),
            }
        )
    return {
        "id": r.id,
        "model_name": r.model_name,
        "model_version": r.model_version,
        "parameters": sorted(r.parameters),
        "raw_output_contents": len(r.raw_output_contents),
        "outputs": outs,
    }


def expected_values(case: InferCase) -> dict[str, Any]:
    """What the comparison models compute, canonical (sanity check that both servers really ran)."""
    ins = {t.name: t for t in case.inputs}
    if case.model == "add_sub":
        a, b = ins["INPUT0"].values, ins["INPUT1"].values
        return {
            "OUTPUT0": (a + b).astype(np.float32).tobytes(),
            "OUTPUT1": (a - b).astype(np.float32).tobytes(),
        }
    t = ins["INPUT0"]
    return {"OUTPUT0": list(t.values) if t.datatype == "BYTES" else np.asarray(t.values).tobytes()}


# --------------------------------------------------------------------------------------------------
# Success cases: HTTP JSON, HTTP binary, gRPC (raw and typed contents) for every comparison model
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", INFER_CASES, ids=lambda c: c.id)
def test_infer_success(servers: Pair, case: InferCase, protocol: str):
    if protocol.startswith("http"):
        body, headers = build_http(case, binary=protocol == "http_binary")
        path = infer_path(case.model, case.version)
        answers = [http(ep, "POST", path, body, headers) for ep in servers.both()]  # both before asserting
        t, n = (normalise_http_infer(a) for a in answers)
    else:
        req = build_grpc(case, raw=protocol == "grpc_raw")
        answers = [grpc_call(ep, "ModelInfer", req) for ep in servers.both()]
        t, n = (normalise_grpc_infer(a) for a in answers)
    # Triton really computed what we think (guards the comparison itself).
    want = expected_values(case)
    for o in t["outputs"]:
        assert o["values"] == want[o["name"]], f"Triton output {o['name']} unexpected"
    # Field by field first, for readable failures; then everything.
    for key in ("id", "model_name", "model_version"):
        assert n[key] == t[key], f"{key}: triton={t[key]!r} naiad={n[key]!r}"
    assert [o["name"] for o in n["outputs"]] == [o["name"] for o in t["outputs"]], "output names"
    for to, no in zip(t["outputs"], n["outputs"]):
        assert no["datatype"] == to["datatype"], f"{to['name']} datatype"
        assert no["shape"] == to["shape"], f"{to['name']} shape"
        assert no["values"] == to["values"], f"{to['name']} values"
    assert n == t


# --------------------------------------------------------------------------------------------------
# Metadata, config, repository index, statistics
# --------------------------------------------------------------------------------------------------

MODELS = ["identity_fp32", "identity_batched", "add_sub", "identity_bytes"]


def test_server_metadata(servers: Pair):
    from tritonclient.grpc import service_pb2 as pb

    t, n = (http(ep, "GET", "/v2") for ep in servers.both())
    assert n.status == t.status == 200
    tj, nj = t.json(), n.json()
    assert sorted(nj) == sorted(tj)
    for key in set(tj) - set(SERVER_METADATA_VALUES_NOT_COMPARED) - {"extensions"}:
        assert nj[key] == tj[key], key
    want = [e for e in tj["extensions"] if e not in EXTENSIONS_ONLY_TRITON]
    assert nj["extensions"] == want, f"triton={tj['extensions']} naiad={nj['extensions']}"
    tg, ng = (grpc_call(ep, "ServerMetadata", pb.ServerMetadataRequest()) for ep in servers.both())
    assert list(ng.response.extensions) == [
        e for e in tg.response.extensions if e not in EXTENSIONS_ONLY_TRITON
    ]


@pytest.mark.parametrize("suffix", ["", "/versions/1"])
@pytest.mark.parametrize("model", MODELS)
def test_model_metadata(servers: Pair, model: str, suffix: str):
    from google.protobuf import json_format
    from tritonclient.grpc import service_pb2 as pb

    t, n = (http(ep, "GET", f"/v2/models/{model}{suffix}") for ep in servers.both())
    assert n.status == t.status == 200
    assert n.json() == t.json()
    req = pb.ModelMetadataRequest(name=model, version="1" if suffix else "")
    tg, ng = (grpc_call(ep, "ModelMetadata", req) for ep in servers.both())
    assert json_format.MessageToDict(ng.response) == json_format.MessageToDict(tg.response)


def _keys_minus(d: dict, exempt: dict) -> set:
    return set(d) - set(exempt)


@pytest.mark.parametrize("model", MODELS)
def test_model_config(servers: Pair, model: str):
    t, n = (http(ep, "GET", f"/v2/models/{model}/config") for ep in servers.both())
    assert n.status == t.status == 200
    tc, nc = t.json(), n.json()
    # Top-level key sets, less the listed deliberate differences.
    assert set(nc) - set(CONFIG_KEYS_ONLY_NAIAD) == set(tc) - set(CONFIG_KEYS_ONLY_TRITON), (
        f"keys only in Triton: {sorted(set(tc) - set(nc) - set(CONFIG_KEYS_ONLY_TRITON))}, "
        f"only in Naiad: {sorted(set(nc) - set(tc) - set(CONFIG_KEYS_ONLY_NAIAD))}"
    )
    # The fields both normalise, explicitly.
    for key in ("name", "max_batch_size", "version_policy", "backend", "platform", "default_model_filename"):
        assert nc.get(key) == tc.get(key), f"{key}: triton={tc.get(key)!r} naiad={nc.get(key)!r}"
    for section in ("input", "output"):
        assert len(nc[section]) == len(tc[section])
        for te, ne in zip(tc[section], nc[section]):
            assert set(ne) == set(te) - set(CONFIG_IO_KEYS_ONLY_TRITON), (
                f"{section} keys: only Triton {sorted(set(te) - set(ne))}, only Naiad {sorted(set(ne) - set(te))}"
            )
            for k in set(ne) & set(te):
                assert ne[k] == te[k], f"{section} {te['name']}.{k}: triton={te[k]!r} naiad={ne[k]!r}"
    assert ("dynamic_batching" in nc) == ("dynamic_batching" in tc)
    if "dynamic_batching" in tc:
        assert (
            nc["dynamic_batching"] == tc["dynamic_batching"]
        )  # incl. preferred_batch_size = [max_batch_size]
    assert [(g["kind"], g["count"]) for g in nc["instance_group"]] == [
        (g["kind"], g["count"]) for g in tc["instance_group"]
    ]
    for tg, ng in zip(tc["instance_group"], nc["instance_group"]):
        assert ng == tg
    # Every other field both print: same value.
    skip = set(CONFIG_VALUES_NOT_COMPARED) | {"input", "output"}  # input/output compared above
    for key in sorted((set(tc) & set(nc)) - skip):
        assert nc[key] == tc[key], f"{key}: triton={tc[key]!r} naiad={nc[key]!r}"


@pytest.mark.parametrize("model", MODELS)
def test_model_config_grpc(servers: Pair, model: str):
    """gRPC ModelConfig, read through Naiad's model_config.proto (fields it lacks are skipped for both)."""
    from google.protobuf import json_format
    from tritonclient.grpc import service_pb2 as pb

    t, n = (grpc_call(ep, "ModelConfig", pb.ModelConfigRequest(name=model)) for ep in servers.both())
    assert n.code == t.code
    tc, nc = (json_format.MessageToDict(a.response.config, preserving_proto_field_name=True) for a in (t, n))
    for key in CONFIG_KEYS_ONLY_TRITON:
        tc.pop(key, None)
    for key in sorted(set(tc) | set(nc)):
        assert nc.get(key) == tc.get(key), f"{key}: triton={tc.get(key)!r} naiad={nc.get(key)!r}"


@pytest.mark.parametrize("accept", ["gzip", "deflate", "gzip, deflate", "identity"])
def test_http_response_compression(servers: Pair, accept: str):
    """The same `Accept-Encoding` → the same `Content-Encoding` (requests' default is 'gzip, deflate')."""
    body = json.dumps({"inputs": [_fp32_input()]}).encode()
    headers = {"Content-Type": "application/json", "Accept-Encoding": accept}
    t, n = (
        requests.post(ep.http_url + infer_path("identity_fp32"), data=body, headers=headers, timeout=30)
        for ep in servers.both()
    )
    assert (n.status_code, n.headers.get("Content-Encoding")) == (
        t.status_code,
        t.headers.get("Content-Encoding"),
    )
    assert n.json()["outputs"] == t.json()["outputs"]


def _index_entries(entries: list[dict]) -> list[dict]:
    out = []
    for e in entries:
        out.append(
            {
                "keys": sorted(e),
                "name": e.get("name"),
                "version": e.get("version"),
                "state": e.get("state"),
                "reason_nonempty": bool(e.get("reason")),
            }
        )
    return out


def _entry_diffs(t: list[dict], n: list[dict]) -> list[str]:
    diffs = []
    for te, ne in zip(t, n):
        if te != ne:
            diffs.append(f"{te['name']}: triton={te} naiad={ne}")
    return diffs


def test_repository_index_http(servers: Pair):
    t, n = (http(ep, "POST", "/v2/repository/index", {}) for ep in servers.both())
    assert n.status == t.status == 200
    tj, nj = t.json(), n.json()
    assert [e["name"] for e in nj] == [e["name"] for e in tj]
    # The failure text differs (Triton includes its own traceback); both must carry the model's message.
    for e in nj:
        if e.get("state") != "READY":
            assert "broken model: initialize() always fails" in e.get("reason", "")
    diffs = _entry_diffs(_index_entries(tj), _index_entries(nj))
    assert diffs == [], "\n".join(diffs)


def test_repository_index_grpc(servers: Pair):
    from tritonclient.grpc import service_pb2 as pb

    t, n = (grpc_call(ep, "RepositoryIndex", pb.RepositoryIndexRequest()) for ep in servers.both())
    assert n.code == t.code

    def norm(a):
        return [
            {
                "name": m.name,
                "version": m.version,
                "state": m.state,
                "reason_nonempty": bool(m.reason),
            }
            for m in a.response.models
        ]

    assert [e["name"] for e in norm(n)] == [e["name"] for e in norm(t)]
    diffs = _entry_diffs(norm(t), norm(n))
    assert diffs == [], "\n".join(diffs)


def _key_tree(x) -> Any:
    """The nested key structure of a JSON value (values dropped; lists keep one key tree per element)."""
    if isinstance(x, dict):
        return {k: _key_tree(v) for k, v in x.items()}
    if isinstance(x, list):  # the distinct element structures (list lengths are values, not keys)
        return sorted({json.dumps(_key_tree(v), sort_keys=True) for v in x})
    return type(x).__name__ if not isinstance(x, (int, float)) or isinstance(x, bool) else "number"


def _counts(stats: dict) -> dict:
    out = {}
    for m in stats["model_stats"]:
        s = m["inference_stats"]
        out[(m["name"], m["version"])] = {
            "inference_count": m["inference_count"],
            "execution_count": m["execution_count"],
            "success": s["success"]["count"],
            "fail": s["fail"]["count"],
            "batch_sizes": sorted(b["batch_size"] for b in m["batch_stats"]),
        }
    return out


def _same_traffic(servers: Pair) -> None:
    """A small fixed sequence to both servers: successes, a validation failure, a binary request."""
    for ep in servers.both():
        for case in INFER_CASES[:4]:
            body, headers = build_http(case, binary=False)
            assert http(ep, "POST", infer_path(case.model), body, headers).status == 200
        bad = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "INT32", "data": [1, 2, 3]}]}
        assert http(ep, "POST", infer_path("identity_fp32"), bad).status == 400


@pytest.mark.parametrize(
    "path",
    ["/v2/models/stats", "/v2/models/identity_fp32/stats", "/v2/models/identity_batched/versions/1/stats"],
)
def test_statistics_keys(servers: Pair, path: str):
    _same_traffic(servers)
    t, n = (http(ep, "GET", path) for ep in servers.both())
    assert n.status == t.status == 200
    assert _key_tree(n.json()) == _key_tree(t.json())


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for key, a in after.items():
        b = before.get(key, {})
        out[key] = {k: (v - b[k] if isinstance(v, (int, float)) and k in b else v) for k, v in a.items()}
    return out


def _settled(read: Callable[[], tuple[Any, Any]], timeout: float = 3.0) -> tuple[Any, Any]:
    """Read both sides until they agree or `timeout` passes (statistics land just after the response)."""
    deadline = time.monotonic() + timeout
    while True:
        t, n = read()
        if t == n or time.monotonic() > deadline:
            return t, n
        time.sleep(0.2)


def test_statistics_counts(servers: Pair):
    """The same traffic to both: the same count deltas (validation failures are not counted)."""
    before = [_counts(http(ep, "GET", "/v2/models/stats").json()) for ep in servers.both()]
    _same_traffic(servers)

    def read():
        after = [_counts(http(ep, "GET", "/v2/models/stats").json()) for ep in servers.both()]
        return tuple(_delta(a, b) for a, b in zip(after, before))

    t, n = _settled(read)
    assert sorted(n) == sorted(t), "models listed"
    for key in sorted(t):
        tt, nn = dict(t[key]), dict(n[key])
        tt.pop("batch_sizes"), nn.pop("batch_sizes")
        assert nn == tt, f"{key}: triton={tt} naiad={nn}"


# --------------------------------------------------------------------------------------------------
# Error cases: same HTTP status and the same gRPC status code
# --------------------------------------------------------------------------------------------------


def _fp32_input(name="INPUT0", shape=(1, 3), data=(1, 2.5, 3), datatype="FP32") -> dict:
    return {"name": name, "shape": list(shape), "datatype": datatype, "data": list(data)}


def _g_infer(
    model: str,
    inputs: list[tuple[str, str, list, list]],
    version: str = "",
    outputs: tuple[str, ...] = (),
    raw: bool = False,
    request_id: str = "",
):
    """A ModelInferRequest from (name, datatype, shape, values) tuples."""
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, datatype, shape, values in inputs:
        inp = req.inputs.add(name=name, datatype=datatype, shape=shape)
        if raw:
            req.raw_input_contents.append(np.asarray(values, dtype=NP_DTYPE[datatype]).tobytes())
        elif datatype == "FP32":
            inp.contents.fp32_contents.extend(values)
        elif datatype == "INT32":
            inp.contents.int_contents.extend(values)
    for o in outputs:
        req.outputs.add(name=o)
    return req


def _pb(factory: str, **kw):
    def make():
        from tritonclient.grpc import service_pb2 as pb

        return getattr(pb, factory)(**kw)

    return make


Z16 = [0.0] * 16


@dataclasses.dataclass(frozen=True)
class ErrorCase:
    id: str
    http: tuple | None  # (method, path, body, headers)
    grpc: tuple[str, Callable] | None = None  # (rpc, () -> request)
    # For RPCs that answer OK with a flag (ModelReady), the flag is compared too.
    grpc_field: str | None = None


HDR_BODY = json.dumps(
    {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "parameters": {"binary_data_size": 12}}
        ]
    }
).encode()

ERROR_CASES = [
    # --- required by the brief ---
    ErrorCase(
        "unknown_model",
        ("POST", infer_path("nope"), {"inputs": [_fp32_input()]}, None),
        ("ModelInfer", lambda: _g_infer("nope", [("INPUT0", "FP32", [1, 3], [1, 2.5, 3])])),
    ),
    ErrorCase(
        "unknown_version",
        ("POST", infer_path("identity_fp32", "7"), {"inputs": [_fp32_input()]}, None),
        ("ModelInfer", lambda: _g_infer("identity_fp32", [("INPUT0", "FP32", [1, 3], [1, 2.5, 3])], "7")),
    ),
    ErrorCase(
        "wrong_datatype",
        (
            "POST",
            infer_path("identity_fp32"),
            {"inputs": [_fp32_input(datatype="INT32", data=(1, 2, 3))]},
            None,
        ),
        ("ModelInfer", lambda: _g_infer("identity_fp32", [("INPUT0", "INT32", [1, 3], [1, 2, 3])])),
    ),
    ErrorCase(
        "wrong_shape_missing_batch_dim",
        ("POST", infer_path("identity_fp32"), {"inputs": [_fp32_input(shape=(3,))]}, None),
        ("ModelInfer", lambda: _g_infer("identity_fp32", [("INPUT0", "FP32", [3], [1, 2, 3])])),
    ),
    ErrorCase(
        "wrong_shape_fixed_dims",
        (
            "POST",
            infer_path("add_sub"),
            {"inputs": [_fp32_input(shape=(15,), data=Z16[:15]), _fp32_input("INPUT1", (15,), Z16[:15])]},
            None,
        ),
        (
            "ModelInfer",
            lambda: _g_infer(
                "add_sub", [("INPUT0", "FP32", [15], Z16[:15]), ("INPUT1", "FP32", [15], Z16[:15])]
            ),
        ),
    ),
    ErrorCase(
        "missing_input",
        ("POST", infer_path("add_sub"), {"inputs": [_fp32_input(shape=(16,), data=Z16)]}, None),
        ("ModelInfer", lambda: _g_infer("add_sub", [("INPUT0", "FP32", [16], Z16)])),
    ),
    ErrorCase(
        "batch_above_max_batch_size",
        ("POST", infer_path("identity_fp32"), {"inputs": [_fp32_input(shape=(9, 1), data=[0.0] * 9)]}, None),
        ("ModelInfer", lambda: _g_infer("identity_fp32", [("INPUT0", "FP32", [9, 1], [0.0] * 9)])),
    ),
    ErrorCase(
        "batch_above_max_batch_size_dynamic_batcher",
        (
            "POST",
            infer_path("identity_batched"),
            {"inputs": [_fp32_input(shape=(17, 1), data=[0.0] * 17)]},
            None,
        ),
        ("ModelInfer", lambda: _g_infer("identity_batched", [("INPUT0", "FP32", [17, 1], [0.0] * 17)])),
    ),
    ErrorCase(
        "unknown_requested_output",
        (
            "POST",
            infer_path("identity_fp32"),
            {"inputs": [_fp32_input()], "outputs": [{"name": "OUTPUT9"}]},
            None,
        ),
        (
            "ModelInfer",
            lambda: _g_infer(
                "identity_fp32", [("INPUT0", "FP32", [1, 3], [1, 2.5, 3])], outputs=("OUTPUT9",)
            ),
        ),
    ),
    ErrorCase(
        "binary_header_length_larger_than_body",
        ("POST", infer_path("identity_fp32"), HDR_BODY + b"\0" * 12, {HEADER_LENGTH: "199"}),
        None,
    ),
    ErrorCase(
        "model_ready_unknown_model",
        ("GET", "/v2/models/nope/ready", None, None),
        ("ModelReady", _pb("ModelReadyRequest", name="nope")),
        grpc_field="ready",
    ),
    ErrorCase(
        "load_in_mode_none",
        ("POST", "/v2/repository/models/identity_fp32/load", {}, None),
        ("RepositoryModelLoad", _pb("RepositoryModelLoadRequest", model_name="identity_fp32")),
    ),
    ErrorCase(
        "unload_in_mode_none",
        ("POST", "/v2/repository/models/identity_fp32/unload", {}, None),
        ("RepositoryModelUnload", _pb("RepositoryModelUnloadRequest", model_name="identity_fp32")),
    ),
    # --- deliberate differences (see DELIBERATE_DIFFERENCES) ---
    ErrorCase(
        "malformed_json",
        ("POST", infer_path("identity_fp32"), b"{not json", {"Content-Type": "application/json"}),
        None,
    ),
    ErrorCase(
        "data_length_mismatch_json",
        ("POST", infer_path("identity_fp32"), {"inputs": [_fp32_input(shape=(1, 4))]}, None),
        # gRPC has no parse step: both answer INVALID_ARGUMENT (byte size mismatch)
        ("ModelInfer", lambda: _g_infer("identity_fp32", [("INPUT0", "FP32", [1, 4], [1, 2, 3])])),
    ),
    # --- further cases from docs/triton-behaviour.md ---
    ErrorCase(
        "raw_contents_length_mismatch",
        None,
        ("ModelInfer", lambda: _g_infer("identity_fp32", [("INPUT0", "FP32", [1, 4], [1, 2, 3])], raw=True)),
    ),
    ErrorCase(
        "model_failed_to_load_infer",
        ("POST", infer_path("broken"), {"inputs": [_fp32_input(shape=(3,), data=(1, 2, 3))]}, None),
        ("ModelInfer", lambda: _g_infer("broken", [("INPUT0", "FP32", [3], [1, 2, 3])])),
    ),
    ErrorCase(
        "non_numeric_version",
        ("POST", "/v2/models/identity_fp32/versions/abc/infer", {"inputs": [_fp32_input()]}, None),
        ("ModelInfer", lambda: _g_infer("identity_fp32", [("INPUT0", "FP32", [1, 3], [1, 2.5, 3])], "abc")),
    ),
    ErrorCase(
        "unexpected_extra_input",
        ("POST", infer_path("identity_fp32"), {"inputs": [_fp32_input(), _fp32_input("INPUT1")]}, None),
        (
            "ModelInfer",
            lambda: _g_infer(
                "identity_fp32",
                [("INPUT0", "FP32", [1, 3], [1, 2.5, 3]), ("INPUT1", "FP32", [1, 3], [1, 2, 3])],
            ),
        ),
    ),
    ErrorCase(
        "empty_inputs_list",
        ("POST", infer_path("identity_fp32"), {"inputs": []}, None),
        ("ModelInfer", lambda: _g_infer("identity_fp32", [])),
    ),
    ErrorCase(
        "duplicate_input",
        ("POST", infer_path("identity_fp32"), {"inputs": [_fp32_input(), _fp32_input()]}, None),
    ),
    ErrorCase(
        "invalid_datatype_string",
        ("POST", infer_path("identity_fp32"), {"inputs": [_fp32_input(datatype="FLOAT")]}, None),
    ),
    ErrorCase(
        "input_without_data",
        (
            "POST",
            infer_path("identity_fp32"),
            {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32"}]},
            None,
        ),
        ("ModelInfer", lambda: _g_infer("identity_fp32", [("INPUT0", "FP32", [1, 3], [])])),
    ),
    ErrorCase("no_inputs_key", ("POST", infer_path("identity_fp32"), {"id": "x"}, None)),
    ErrorCase(
        "input_without_shape",
        (
            "POST",
            infer_path("identity_fp32"),
            {"inputs": [{"name": "INPUT0", "datatype": "FP32", "data": [1, 2, 3]}]},
            None,
        ),
    ),
    ErrorCase(
        "negative_shape_dim",
        ("POST", infer_path("identity_fp32"), {"inputs": [_fp32_input(shape=(-1, 3))]}, None),
    ),
    ErrorCase(
        "data_element_wrong_json_type",
        ("POST", infer_path("identity_fp32"), {"inputs": [_fp32_input(data=(1, True, 3))]}, None),
    ),
    ErrorCase(
        "binary_part_shorter_than_binary_data_size",
        ("POST", infer_path("identity_fp32"), HDR_BODY + b"\0" * 8, {HEADER_LENGTH: str(len(HDR_BODY))}),
    ),
    ErrorCase(
        "binary_part_longer_than_binary_data_size",
        ("POST", infer_path("identity_fp32"), HDR_BODY + b"\0" * 16, {HEADER_LENGTH: str(len(HDR_BODY))}),
    ),
    ErrorCase("get_on_infer", ("GET", infer_path("identity_fp32"), None, None)),
    ErrorCase("empty_body_is_a_raw_request_200", ("POST", infer_path("identity_fp32"), b"", None)),
    ErrorCase(
        "raw_binary_request_header_zero_200",
        ("POST", infer_path("identity_fp32"), np.ones(3, np.float32).tobytes(), {HEADER_LENGTH: "0"}),
    ),
    ErrorCase("unknown_route", ("GET", "/v2/nonexistent", None, None)),
    ErrorCase(
        "metadata_unknown_model",
        ("GET", "/v2/models/nope", None, None),
        ("ModelMetadata", _pb("ModelMetadataRequest", name="nope")),
    ),
    ErrorCase(
        "metadata_failed_model",
        ("GET", "/v2/models/broken", None, None),
        ("ModelMetadata", _pb("ModelMetadataRequest", name="broken")),
    ),
    ErrorCase(
        "metadata_failed_model_explicit_version",
        ("GET", "/v2/models/broken/versions/1", None, None),
        ("ModelMetadata", _pb("ModelMetadataRequest", name="broken", version="1")),
    ),
    ErrorCase(
        "metadata_unknown_version",
        ("GET", "/v2/models/identity_fp32/versions/2", None, None),
        ("ModelMetadata", _pb("ModelMetadataRequest", name="identity_fp32", version="2")),
    ),
    ErrorCase(
        "config_unknown_model",
        ("GET", "/v2/models/nope/config", None, None),
        ("ModelConfig", _pb("ModelConfigRequest", name="nope")),
    ),
    ErrorCase(
        "model_ready_unknown_version",
        ("GET", "/v2/models/identity_fp32/versions/2/ready", None, None),
        ("ModelReady", _pb("ModelReadyRequest", name="identity_fp32", version="2")),
        grpc_field="ready",
    ),
    ErrorCase(
        "model_ready_failed_model",
        ("GET", "/v2/models/broken/ready", None, None),
        ("ModelReady", _pb("ModelReadyRequest", name="broken")),
        grpc_field="ready",
    ),
    ErrorCase(
        "stats_unknown_model",
        ("GET", "/v2/models/nope/stats", None, None),
        ("ModelStatistics", _pb("ModelStatisticsRequest", name="nope")),
    ),
    ErrorCase(
        "stats_unknown_version",
        ("GET", "/v2/models/identity_fp32/versions/2/stats", None, None),
        ("ModelStatistics", _pb("ModelStatisticsRequest", name="identity_fp32", version="2")),
    ),
]


@pytest.mark.parametrize("case", [c for c in ERROR_CASES if c.http], ids=lambda c: c.id)
def test_error_http_status(servers: Pair, case: ErrorCase):
    method, path, body, headers = case.http
    t, n = (http(ep, method, path, body, headers) for ep in servers.both())
    deliberate = DELIBERATE_DIFFERENCES.get(case.id)
    if deliberate is not None:
        assert t.status == deliberate.triton_http, (
            f"Triton changed; update DELIBERATE_DIFFERENCES: {t.describe()}"
        )
        assert n.status == deliberate.naiad_http, n.describe()
    else:
        assert n.status == t.status, f"triton: {t.describe()}  naiad: {n.describe()}"
    if t.status >= 400 and t.body:
        # Both use Triton's error body shape {"error": "<message>"}.
        assert set(n.json()) == {"error"} and isinstance(n.json()["error"], str), n.describe()


@pytest.mark.parametrize("case", [c for c in ERROR_CASES if c.grpc], ids=lambda c: c.id)
def test_error_grpc_status(servers: Pair, case: ErrorCase):
    rpc, make = case.grpc
    t, n = (grpc_call(ep, rpc, make()) for ep in servers.both())
    assert n.code == t.code, f"triton: {t.describe()}  naiad: {n.describe()}"
    if case.grpc_field:
        assert getattr(n.response, case.grpc_field) == getattr(t.response, case.grpc_field)


# --------------------------------------------------------------------------------------------------
# Metrics: families, types and label names after the same traffic
# --------------------------------------------------------------------------------------------------


def _families(url: str) -> dict[str, dict]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url, timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        labels = set()
        values = {}
        for s in fam.samples:
            labels |= set(s.labels)
            values[tuple(sorted(s.labels.items()))] = s.value
        out[fam.name] = {"type": fam.type, "labels": labels, "values": values}
    return out


@pytest.fixture(scope="module")
def metric_families(servers: Pair):
    _same_traffic(servers)
    time.sleep(0.5)
    return tuple(_families(ep.metrics_url) for ep in servers.both())


def test_metrics_family_sets(metric_families):
    tf, nf = metric_families
    only_triton = sorted(set(tf) - set(nf) - set(TRITON_ONLY_FAMILIES))
    only_naiad = sorted(f for f in set(nf) - set(tf) if not naiad_only_family_ok(f))
    assert (only_triton, only_naiad) == ([], []), (
        f"families only Triton exposes: {only_triton}; only Naiad (not listed): {only_naiad}"
    )


def test_metrics_types_and_labels(metric_families):
    tf, nf = metric_families
    diffs = []
    for name in sorted(set(tf) & set(nf)):
        if tf[name]["type"] != nf[name]["type"]:
            diffs.append(f"{name}: type triton={tf[name]['type']} naiad={nf[name]['type']}")
        if tf[name]["labels"] != nf[name]["labels"]:
            diffs.append(
                f"{name}: labels triton={sorted(tf[name]['labels'])} naiad={sorted(nf[name]['labels'])}"
            )
    assert diffs == [], "\n".join(diffs)


COUNTER_FAMILIES = [
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
]


@pytest.mark.parametrize("family", COUNTER_FAMILIES)
def test_metrics_counter_series_and_deltas(servers: Pair, family: str):
    """Same series (model, version[, reason]) on both; the same traffic moves them by the same amounts
    (validation failures leave nv_inference_request_failure alone)."""
    before = [_families(ep.metrics_url).get(family, {}).get("values", {}) for ep in servers.both()]
    _same_traffic(servers)

    def read():
        after = [_families(ep.metrics_url).get(family, {}).get("values", {}) for ep in servers.both()]
        return tuple({k: v - b.get(k, 0) for k, v in a.items()} for a, b in zip(after, before))

    t, n = _settled(read)
    problems = []
    for k in sorted(set(t) | set(n)):
        name = ",".join(f"{a}={b}" for a, b in k)
        if k not in n:
            problems.append(f"series only Triton exposes: {{{name}}}")
        elif k not in t:
            problems.append(f"series only Naiad exposes: {{{name}}}")
        elif t[k] != n[k]:
            problems.append(f"{{{name}}}: triton +{t[k]:g}, naiad +{n[k]:g}")
    assert problems == [], "\n".join(problems)


# --------------------------------------------------------------------------------------------------
# Real clients (issue 12): a second pair, explicit model control, tests/client_models.py's repository
# --------------------------------------------------------------------------------------------------

ONLY_ONE = (
    "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
    "'shared_memory_region' in 'parameters'. But set "
)


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    import grpc
    from client_models import CLIENT_MODELS, build_client_repo
    from tritonclient.grpc import service_pb2_grpc

    repo = build_client_repo(tmp_path_factory.mktemp("clients") / "models")
    hp, gp, mp = free_ports(3)
    triton_args = ["--model-control-mode=explicit", *[f"--load-model={m}" for m in CLIENT_MODELS]]
    naiad_args = [x for m in CLIENT_MODELS for x in ("--load-model", m)]
    with tritonserver(repo, hp, gp, mp, triton_args, timeout=120) as t:
        naiad = NaiadProcess(repo, "--model-control-mode", "explicit", *naiad_args)
        naiad.start()
        try:
            pair = Pair(
                Endpoint("triton", t.http_url, t.grpc_url, t.metrics_url),
                Endpoint("naiad", naiad.url, naiad.grpc, f"http://{naiad.metrics}/metrics"),
            )
            for ep in pair.both():
                ep.channel = grpc.insecure_channel(ep.grpc_addr)
                grpc.channel_ready_future(ep.channel).result(timeout=30)
                ep.stub = service_pb2_grpc.GRPCInferenceServiceStub(ep.channel)
            yield pair
            for ep in pair.both():
                ep.channel.close()
        finally:
            naiad.stop()


def _same_http(case_id: str, t: HttpAnswer, n: HttpAnswer, same_body: bool = True) -> None:
    """Status as Triton's (or as listed in DELIBERATE_DIFFERENCES); the body too unless `same_body` is False."""
    deliberate = DELIBERATE_DIFFERENCES.get(case_id)
    if deliberate is not None:
        assert t.status == deliberate.triton_http, (
            f"Triton changed; update DELIBERATE_DIFFERENCES: {t.describe()}"
        )
        assert n.status == deliberate.naiad_http, n.describe()
    else:
        assert n.status == t.status, f"triton: {t.describe()}  naiad: {n.describe()}"
    if same_body:
        assert (n.json() if n.body else None) == (t.json() if t.body else None), (
            f"triton: {t.describe()}  naiad: {n.describe()}"
        )


def _same_grpc(case_id: str, t: GrpcAnswer, n: GrpcAnswer, same_details: bool = True) -> None:
    deliberate = DELIBERATE_DIFFERENCES.get(case_id)
    if deliberate is not None and deliberate.triton_grpc:
        assert t.code.name == deliberate.triton_grpc, (
            f"Triton changed; update DELIBERATE_DIFFERENCES: {t.describe()}"
        )
        assert n.code.name == deliberate.naiad_grpc, n.describe()
    else:
        assert n.code == t.code, f"triton: {t.describe()}  naiad: {n.describe()}"
    if same_details:
        assert n.details == t.details, f"triton: {t.describe()}  naiad: {n.describe()}"


# ---- 1. reshape ----


def test_reshape_config_and_metadata(clients: Pair):
    t, n = (http(ep, "GET", "/v2/models/reshape_py/config").json() for ep in clients.both())
    for key in ("input", "output"):
        assert [(e["name"], e["dims"], e.get("reshape")) for e in n[key]] == [
            (e["name"], e["dims"], e.get("reshape")) for e in t[key]
        ]
    t, n = (http(ep, "GET", "/v2/models/reshape_py").json() for ep in clients.both())
    assert n == t


@pytest.mark.parametrize(
    ("model", "shape"),
    [("reshape_py", [2, 12]), ("reshape_nobatch", [12]), ("reshape_py", [1, 3, 4]), ("reshape_py", [2, 11])],
    ids=["batched", "no_batch", "reshape_shape_sent", "wrong_shape"],
)
def test_reshape_infer(clients: Pair, model: str, shape: list[int]):
    count = int(np.prod(shape))
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": shape, "data": list(range(count))}]}
    t, n = (http(ep, "POST", infer_path(model), body) for ep in clients.both())
    _same_http(f"reshape_{model}_{shape}", t, n)
    req = _g_infer(model, [("INPUT0", "FP32", shape, [float(v) for v in range(count)])])
    t, n = (grpc_call(ep, "ModelInfer", req) for ep in clients.both())
    _same_grpc(f"reshape_{model}_{shape}", t, n)
    if t.response is not None:
        assert normalise_grpc_infer(n) == normalise_grpc_infer(t)


# ---- 2. outputs in system shared memory ----


@pytest.fixture
def shm_regions(clients: Pair):
    """One 128-byte region named 'out' on each server, each over its own POSIX object."""
    import tritonclient.utils.shared_memory as shm

    handles = {}
    for ep in clients.both():
        key = f"/naiad_cmp_{ep.name}"
        handles[ep.name] = shm.create_shared_memory_region(f"out_{ep.name}", key, 128)
        body = {"key": key, "offset": 0, "byte_size": 128}
        answer = http(ep, "POST", "/v2/systemsharedmemory/region/out/register", body)
        assert answer.status == 200, answer.describe()
    yield handles
    for ep in clients.both():
        answer = _unregister_when_released(ep, "out")
        assert answer.status == 200, answer.describe()
    for handle in handles.values():
        shm.destroy_shared_memory_region(handle)


def test_shared_memory_outputs_http(clients: Pair, shm_regions):
    import tritonclient.utils.shared_memory as shm

    ones = {"datatype": "FP32", "shape": [16], "data": [1.0] * 16}
    params = {"shared_memory_region": "out", "shared_memory_byte_size": 64}
    for second in ({**params, "shared_memory_offset": 64}, {"binary_data": False}):
        body = {
            "inputs": [{"name": "INPUT0", **ones}, {"name": "INPUT1", **ones}],
            "outputs": [{"name": "OUTPUT0", "parameters": params}, {"name": "OUTPUT1", "parameters": second}],
        }
        t, n = (http(ep, "POST", infer_path("add_sub"), body) for ep in clients.both())
        _same_http("shm_outputs_http", t, n)
    t, n = (shm.get_contents_as_numpy(shm_regions[name], np.float32, [32]) for name in ("triton", "naiad"))
    np.testing.assert_array_equal(n, t)


def test_shared_memory_outputs_grpc(clients: Pair, shm_regions):
    for both_in_shm in (False, True):
        req = _g_infer("add_sub", [(name, "FP32", [16], [1.0] * 16) for name in ("INPUT0", "INPUT1")])
        for i, name in enumerate(("OUTPUT0", "OUTPUT1")):
            o = req.outputs.add(name=name)
            if i == 0 or both_in_shm:
                o.parameters["shared_memory_region"].string_param = "out"
                o.parameters["shared_memory_byte_size"].int64_param = 64
                o.parameters["shared_memory_offset"].int64_param = 64 * i
        t, n = (grpc_call(ep, "ModelInfer", req) for ep in clients.both())
        _same_grpc("shm_outputs_grpc", t, n)
        assert list(n.response.raw_output_contents) == list(t.response.raw_output_contents)
        assert [dict(o.parameters) for o in n.response.outputs] == [
            dict(o.parameters) for o in t.response.outputs
        ]


# ---- 3. CUDA shared memory without a GPU ----


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v2/cudasharedmemory/status"),
        ("GET", "/v2/cudasharedmemory/region/nope/status"),
        ("POST", "/v2/cudasharedmemory/unregister"),
        ("POST", "/v2/cudasharedmemory/region/nope/unregister"),
    ],
)
def test_cuda_shared_memory_without_gpu_http(clients: Pair, method: str, path: str):
    t, n = (http(ep, method, path) for ep in clients.both())
    _same_http("cuda_shm", t, n)


def test_cuda_shared_memory_without_gpu_grpc(clients: Pair):
    from tritonclient.grpc import service_pb2 as pb

    for rpc, req in (
        ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest()),
        ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest(name="nope")),
        ("CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest()),
        ("CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest(name="nope")),
    ):
        t, n = (grpc_call(ep, rpc, req) for ep in clients.both())
        _same_grpc("cuda_shm", t, n)


def test_cuda_shared_memory_register_without_gpu_is_refused(clients: Pair):
    """Same status; the texts differ on purpose: Triton complains about the handle, Naiad says it has no GPU."""
    body = {"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 16}
    t, n = (http(ep, "POST", "/v2/cudasharedmemory/region/r/register", body) for ep in clients.both())
    _same_http("cuda_shm_register", t, n, same_body=False)


# ---- 4. model control errors ----


def _index_states(ep: Endpoint) -> dict[str, str]:
    return {e["name"]: e.get("state", "") for e in http(ep, "POST", "/v2/repository/index", {}).json()}


def test_load_invalid_json_config(clients: Pair):
    from tritonclient.grpc import service_pb2 as pb

    t, n = (
        http(ep, "POST", "/v2/repository/models/identity_fp32/load", {"parameters": {"config": "{not json"}})
        for ep in clients.both()
    )
    _same_http("load_invalid_json_config", t, n, same_body=False)
    prefix = "failed to load 'identity_fp32', "
    assert t.json()["error"].startswith(prefix) and n.json()["error"].startswith(prefix), (t.body, n.body)
    req = pb.RepositoryModelLoadRequest(model_name="identity_fp32")
    req.parameters["config"].string_param = "{not json"
    t, n = (grpc_call(ep, "RepositoryModelLoad", req) for ep in clients.both())
    _same_grpc("load_invalid_json_config", t, n, same_details=False)
    assert t.details.startswith(prefix) and n.details.startswith(prefix)
    for ep in clients.both():  # the loaded version keeps serving
        assert http(ep, "GET", "/v2/models/identity_fp32/ready").status == 200


def test_load_file_override_name_too_long(clients: Pair):
    name = "file:1/" + "x" * 300 + ".py"
    body = {"parameters": {"config": "{}", name: "AAAA"}}
    t, n = (http(ep, "POST", "/v2/repository/models/fresh/load", body) for ep in clients.both())
    _same_http("load_file_name_too_long", t, n, same_body=False)
    assert n.json()["error"].startswith("failed to load 'fresh', ") and name in n.json()["error"]
    assert "fresh" not in _index_states(clients.triton) and "fresh" not in _index_states(clients.naiad)


def test_load_unknown_model_leaves_no_index_entry(clients: Pair):
    t, n = (http(ep, "POST", "/v2/repository/models/nope/load") for ep in clients.both())
    _same_http("load_unknown_model", t, n)
    from tritonclient.grpc import service_pb2 as pb

    t, n = (
        grpc_call(ep, "RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="nope"))
        for ep in clients.both()
    )
    _same_grpc("load_unknown_model", t, n)
    assert "nope" not in _index_states(clients.triton) and "nope" not in _index_states(clients.naiad)


def _settled_index(ep: Endpoint, names: tuple[str, ...], timeout: float = 20.0) -> dict[str, str]:
    """The index states of `names` once no entry is UNLOADING/LOADING any more."""
    deadline = time.monotonic() + timeout
    while True:
        states = {k: v for k, v in _index_states(ep).items() if k in names}
        if not any(v in ("UNLOADING", "LOADING") for v in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.1)


def test_unload_dependents(clients: Pair):
    names = ("ens_dep", "identity_dep", "ens_identity", "identity_fp32")
    unload = {"parameters": {"unload_dependents": True}}
    for ep in clients.both():
        assert http(ep, "POST", "/v2/repository/models/ens_dep/load").status == 200
    t, n = (_settled_index(ep, names) for ep in clients.both())
    assert n == t and t["identity_dep"] == "READY"
    for ep in clients.both():
        assert http(ep, "POST", "/v2/repository/models/ens_dep/unload", unload).status == 200
        assert http(ep, "POST", "/v2/repository/models/ens_identity/unload", unload).status == 200
    t, n = (_settled_index(ep, names) for ep in clients.both())
    # The model the ensemble brought in goes with it; the one loaded by name (--load-model) stays.
    assert n == t and t["identity_dep"] == "UNAVAILABLE" and t["identity_fp32"] == "READY", (t, n)
    for ep in clients.both():
        assert http(ep, "POST", "/v2/repository/models/ens_identity/load").status == 200


# ---- 5. ambiguous inputs, request ids, UINT64 ----


def test_input_with_data_and_binary_data_size(clients: Pair):
    head = json.dumps(
        {"inputs": [{**_fp32_input(shape=(1, 4), data=(1, 2, 3, 4)), "parameters": {"binary_data_size": 16}}]}
    ).encode()
    body = head + np.arange(4, dtype=np.float32).tobytes()
    headers = {HEADER_LENGTH: str(len(head))}
    t, n = (http(ep, "POST", infer_path("identity_fp32"), body, headers) for ep in clients.both())
    _same_http("data_and_binary_data_size", t, n)
    assert n.json()["error"] == ONLY_ONE + "'data' 'binary_data_size'"


def test_input_with_data_and_shared_memory(clients: Pair, shm_regions):
    params = {"shared_memory_region": "out", "shared_memory_byte_size": 16}
    body = {"inputs": [{**_fp32_input(shape=(1, 4), data=(1, 2, 3, 4)), "parameters": params}]}
    t, n = (http(ep, "POST", infer_path("identity_fp32"), body) for ep in clients.both())
    _same_http("data_and_shared_memory", t, n)
    req = _g_infer("identity_fp32", [("INPUT0", "FP32", [1, 4], [1, 2, 3, 4])])
    req.inputs[0].parameters["shared_memory_region"].string_param = "out"
    req.inputs[0].parameters["shared_memory_byte_size"].int64_param = 16
    t, n = (grpc_call(ep, "ModelInfer", req) for ep in clients.both())
    _same_grpc("contents_and_shared_memory", t, n)


def test_grpc_contents_and_raw_input_contents(clients: Pair):
    req = _g_infer("identity_fp32", [("INPUT0", "FP32", [1, 4], [1, 2, 3, 4])])
    req.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    t, n = (grpc_call(ep, "ModelInfer", req) for ep in clients.both())
    _same_grpc("contents_and_raw_input_contents", t, n)
    assert t.details == (
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'identity_fp32'"
    )


@pytest.mark.parametrize("request_id", [5, None, {"a": 1}, ["x"]], ids=repr)
def test_request_id_not_a_string(clients: Pair, request_id):
    body = {"id": request_id, "inputs": [_fp32_input(shape=(1, 4), data=(1, 2, 3, 4))]}
    t, n = (http(ep, "POST", infer_path("identity_fp32"), body) for ep in clients.both())
    _same_http("request_id_not_a_string", t, n)


@pytest.mark.parametrize(
    ("case_id", "data"),
    [
        ("uint64_max", [0, 1, 2**53 + 1, 2**63, 2**64 - 1]),
        ("uint64_past_max", [2**64]),
        ("uint64_negative", [-1]),
    ],
)
def test_uint64_json(clients: Pair, case_id: str, data: list[int]):
    body = {"inputs": [{"name": "INPUT0", "datatype": "UINT64", "shape": [1, len(data)], "data": data}]}
    t, n = (http(ep, "POST", infer_path("identity_u64"), body) for ep in clients.both())
    _same_http(case_id, t, n, same_body=case_id == "uint64_max")
    if t.status == 200:
        assert n.body == t.body  # the exact integers, not doubles


@pytest.fixture
def shm_input(clients: Pair):
    """A 64-byte region 'in0' holding sixteen 2.0s, on each server."""
    import tritonclient.utils.shared_memory as shm

    handles = []
    for ep in clients.both():
        key = f"/naiad_cmp_in0_{ep.name}"
        handle = shm.create_shared_memory_region(f"in0_{ep.name}", key, 64)
        shm.set_shared_memory_region(handle, [np.full(16, 2.0, np.float32)])
        handles.append(handle)
        body = {"key": key, "offset": 0, "byte_size": 64}
        assert http(ep, "POST", "/v2/systemsharedmemory/region/in0/register", body).status == 200
    yield
    for ep in clients.both():
        answer = _unregister_when_released(ep, "in0")
        assert answer.status == 200, answer.describe()
    for handle in handles:
        shm.destroy_shared_memory_region(handle)


def _unregister_when_released(ep, region: str, timeout: float = 5.0):
    """Triton 2.51 releases a region a failed request used a moment after answering it (it answers the
    unregister with 500 "... it is currently in use." meanwhile); Naiad releases it before answering."""
    deadline = time.monotonic() + timeout
    while True:
        answer = http(ep, "POST", f"/v2/systemsharedmemory/region/{region}/unregister")
        if answer.status == 200 or b"currently in use" not in answer.body or time.monotonic() > deadline:
            return answer
        assert ep.name == "triton", answer.describe()
        time.sleep(0.05)


@pytest.mark.parametrize("second", ["one_raw_entry", "typed_contents", "no_data"])
def test_grpc_inputs_mixing_shared_memory_and_tensor_data(clients: Pair, shm_input, second: str):
    """INPUT0 in shared memory; INPUT1 as the only raw entry (what tritonclient sends), as typed contents, or
    with no data at all."""
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name="add_sub")
    i0 = req.inputs.add(name="INPUT0", datatype="FP32", shape=[16])
    i0.parameters["shared_memory_region"].string_param = "in0"
    i0.parameters["shared_memory_byte_size"].int64_param = 64
    i1 = req.inputs.add(name="INPUT1", datatype="FP32", shape=[16])
    if second == "one_raw_entry":
        req.raw_input_contents.append(np.arange(16, dtype=np.float32).tobytes())
    elif second == "typed_contents":
        i1.contents.fp32_contents.extend(range(16))
    t, n = (grpc_call(ep, "ModelInfer", req) for ep in clients.both())
    _same_grpc(f"mixed_{second}", t, n)
    if t.response is not None:
        assert list(n.response.raw_output_contents) == list(t.response.raw_output_contents)


# ---- 7. Triton's grpc_explicit_int8_content_client.py example (issue 34) ----


def _explicit_int8_request(version: str):
    """The example's request: `simple_int8`, INT8 inputs as typed `int_contents`, both outputs asked for."""
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name="simple_int8", model_version=version)
    for name, values in (("INPUT0", range(16)), ("INPUT1", [1] * 16)):
        inp = req.inputs.add(name=name, datatype="INT8", shape=[1, 16])
        inp.contents.int_contents[:] = list(values)
    req.outputs.add(name="OUTPUT0")
    req.outputs.add(name="OUTPUT1")
    return req


def _set_param(params, key: str, kind: str, value) -> None:
    setattr(params[key], kind, value)


# (case, where: "request" or "output", key, gRPC kind, value): Triton's checks of the reserved parameters' kinds
RESERVED_PARAMETERS = [
    ("priority_negative", "request", "priority", "int64_param", -5),
    ("priority_uint64", "request", "priority", "uint64_param", 3),
    ("priority_as_text", "request", "priority", "string_param", "3"),
    ("priority_as_double", "request", "priority", "double_param", 2.0),
    ("timeout_negative", "request", "timeout", "int64_param", -5),
    ("timeout_as_text", "request", "timeout", "string_param", "3"),
    ("timeout_uint64", "request", "timeout", "uint64_param", 3),
    ("classification_negative", "output", "classification", "int64_param", -3),
    ("classification_zero", "output", "classification", "int64_param", 0),
    ("classification_as_text", "output", "classification", "string_param", "a"),
    ("classification_uint64", "output", "classification", "uint64_param", 2),
    ("classification_as_bool", "output", "classification", "bool_param", True),
    ("sequence_id_negative", "request", "sequence_id", "int64_param", -1),
    ("sequence_id_uint64", "request", "sequence_id", "uint64_param", 5),
    ("sequence_id_as_double", "request", "sequence_id", "double_param", 1.5),
    ("sequence_id_as_bool", "request", "sequence_id", "bool_param", True),
    ("sequence_id_empty_text", "request", "sequence_id", "string_param", ""),
    ("sequence_start_as_text", "request", "sequence_start", "string_param", "yes"),
    ("sequence_start_as_int", "request", "sequence_start", "int64_param", 1),
    ("sequence_end_as_text", "request", "sequence_end", "string_param", "x"),
]


@pytest.mark.parametrize(
    "case,where,key,kind,value", RESERVED_PARAMETERS, ids=[c[0] for c in RESERVED_PARAMETERS]
)
def test_reserved_parameters_of_the_wrong_kind_over_grpc(clients: Pair, case, where, key, kind, value):
    """priority (int64 >= 0 or uint64), timeout (int64) and an output's classification (int64 > 0): the same
    answer, word for word, as Triton's."""
    req = _explicit_int8_request("")
    _set_param(req.parameters if where == "request" else req.outputs[0].parameters, key, kind, value)
    t, n = (grpc_call(ep, "ModelInfer", req) for ep in clients.both())
    _same_grpc(case, t, n)
    if t.response is not None:
        assert list(n.response.raw_output_contents) == list(t.response.raw_output_contents)


@pytest.mark.parametrize(
    "where,key,value",
    [
        ("request", "priority", -5),
        ("request", "priority", "3"),
        ("request", "priority", 2.5),
        ("request", "timeout", -5),
        ("request", "timeout", "x"),
        ("output", "classification", -3),
        ("output", "classification", "2"),
        ("output", "classification", 2.5),
        ("output", "classification", True),
        ("request", "sequence_id", -1),
        ("request", "sequence_id", 1.5),
        ("request", "sequence_id", True),
        ("request", "sequence_start", "yes"),
        ("request", "sequence_start", 1),
        ("request", "sequence_start", None),
        ("request", "sequence_end", "x"),
        ("request", "binary_data_output", "no"),
        ("request", "binary_data_output", 1),
        ("output", "binary_data", "yes"),
        ("output", "binary_data", 1),
        ("output", "binary_data", None),
    ],
)
def test_reserved_parameters_of_the_wrong_type_in_json(clients: Pair, where, key, value):
    """priority, timeout, classification (unsigned integers), sequence_id (one, or a string), sequence_start,
    sequence_end, binary_data_output, binary_data (booleans): Triton's JSON parser refuses other types with 500;
    Naiad answers 400 (DELIBERATE_DIFFERENCES' `_PARSE` reason) with Triton's words."""
    body: dict = {
        "inputs": [
            {"name": name, "datatype": "INT8", "shape": [1, 16], "data": [1] * 16}
            for name in ("INPUT0", "INPUT1")
        ],
    }
    if where == "request":
        body["parameters"] = {key: value}
    else:
        body["outputs"] = [{"name": "OUTPUT0", "parameters": {key: value}}]
    t, n = (http(ep, "POST", "/v2/models/simple_int8/infer", body) for ep in clients.both())
    assert t.status == 500, f"Triton changed: {t.describe()}"
    assert n.status == 400, n.describe()
    assert n.json() == t.json()


@pytest.mark.parametrize(
    "path,body,triton_error,naiad_error",
    [
        ("/v2/repository/index", {"ready": "yes"}, "non-boolean as boolean", "non-boolean as boolean"),
        ("/v2/repository/index", {"ready": 1}, "non-boolean as boolean", "non-boolean as boolean"),
        (
            "/v2/repository/models/simple_int8/load",
            {"parameters": []},
            "attempt to get members for non-object",
            "'parameters' must be a JSON object",
        ),
    ],
)
def test_repository_bodies_of_the_wrong_type(clients: Pair, path, body, triton_error, naiad_error):
    """Triton's JSON parser refuses them with 500 and loads nothing; Naiad answers 400 (it took `ready` by truth and
    an empty list as no parameters before). (Unload parameters that are not an object: Triton unloads anyway, Naiad
    answers 400, where it failed with 500 before: tests/test_repository_api.py.)"""
    t, n = (http(ep, "POST", path, body) for ep in clients.both())
    assert t.status == 500 and triton_error in t.json()["error"], f"Triton changed: {t.describe()}"
    assert n.status == 400 and naiad_error in n.json()["error"], n.describe()
    for ep in clients.both():  # nothing was unloaded
        assert http(ep, "GET", "/v2/models/simple_int8/ready").status == 200


@pytest.mark.parametrize(
    "params",
    [{"priority": "3"}, {"priority": -1}, {"timeout": "x"}, {"sequence_id": -1}, {"sequence_start": "yes"}],
    ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()),
)
def test_generate_passes_reserved_parameters_of_another_type_on(clients: Pair, params):
    """The generate extension's parameters go to the request whatever their types: Triton answers them, where its
    infer route refuses them (test_reserved_parameters_of_the_wrong_type_in_json), and so does Naiad."""
    body = {"INPUT0": [1] * 16, "INPUT1": [1] * 16, "parameters": params}
    t, n = (http(ep, "POST", "/v2/models/simple_int8/generate", body) for ep in clients.both())
    assert t.status == 200, f"Triton changed: {t.describe()}"
    assert n.status == 200, n.describe()
    assert n.json() == t.json()


@pytest.mark.parametrize("data", [[[1, 2], [3]], [1, [2, 3]], [[[1]], [2, [3]]]], ids=str)
def test_json_data_nested_unevenly_is_read_in_order(clients: Pair, data):
    """`data` nested in lists of any shape holds its values in order, for Triton (Naiad refused uneven nesting
    with numpy's words before)."""
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": data}]}
    t, n = (http(ep, "POST", "/v2/models/identity_fp32/infer", body) for ep in clients.both())
    assert t.status == 200, f"Triton changed: {t.describe()}"
    assert n.status == 200 and n.json() == t.json(), n.describe()
    assert n.json()["outputs"][0]["data"] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("data", [{"a": 1}, 5, "x", None], ids=str)
def test_json_data_that_is_not_an_array(clients: Pair, data):
    """Triton's parser refuses it with 500; Naiad answers 400 with the same words."""
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": data}]}
    t, n = (http(ep, "POST", "/v2/models/identity_fp32/infer", body) for ep in clients.both())
    assert t.status == 500, f"Triton changed: {t.describe()}"
    assert n.status == 400 and n.json() == t.json(), n.describe()


def _grpc_fp32_input(
    model="identity_fp32",
    datatype="FP32",
    shape=(1, 3),
    contents: dict | None = None,
    raw: bytes | None = None,
):
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model)
    t = req.inputs.add(name="INPUT0", datatype=datatype, shape=list(shape))
    for field, values in (contents or {}).items():
        getattr(t.contents, field).extend(values)
    if raw is not None:
        req.raw_input_contents.append(raw)
    return req


GRPC_INPUT_ERRORS = {
    "typed_contents_short": lambda: _grpc_fp32_input(contents={"fp32_contents": [1, 2]}),
    "typed_contents_long": lambda: _grpc_fp32_input(contents={"fp32_contents": [1, 2, 3, 4]}),
    "typed_contents_of_another_type": lambda: _grpc_fp32_input(contents={"int_contents": [1, 2, 3]}),
    "typed_contents_with_another_type_too": lambda: _grpc_fp32_input(
        contents={"fp32_contents": [1, 2, 3], "int_contents": [1]}
    ),
    "uint64_input_in_int64_contents": lambda: _grpc_fp32_input(
        "identity_u64", "UINT64", (1, 2), {"int64_contents": [1, 2]}
    ),
    "raw_contents_short": lambda: _grpc_fp32_input(raw=b"\0" * 8),
}


@pytest.mark.parametrize("case", list(GRPC_INPUT_ERRORS))
def test_grpc_input_errors_in_triton_s_words(clients: Pair, case):
    """Typed contents of the wrong count or field, raw contents of the wrong size: Triton's code and words."""
    t, n = (grpc_call(ep, "ModelInfer", GRPC_INPUT_ERRORS[case]()) for ep in clients.both())
    assert t.code.name == "INVALID_ARGUMENT", f"Triton changed: {t.describe()}"
    _same_grpc(case, t, n)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_input_given_twice_in_triton_s_words(clients: Pair, protocol):
    if protocol == "grpc":
        req = _grpc_fp32_input(contents={"fp32_contents": [1, 2, 3]})
        req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 3]).contents.fp32_contents.extend([1, 2, 3])
        t, n = (grpc_call(ep, "ModelInfer", req) for ep in clients.both())
        _same_grpc("input_given_twice", t, n)
    else:
        body = {"inputs": [_fp32_input(), _fp32_input()]}
        t, n = (http(ep, "POST", "/v2/models/identity_fp32/infer", body) for ep in clients.both())
        _same_http("input_given_twice", t, n)


def test_binary_data_that_does_not_fill_the_shape_in_triton_s_words(clients: Pair):
    header = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "parameters": {"binary_data_size": 8}}
            ]
        }
    ).encode()
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    t, n = (
        http(ep, "POST", "/v2/models/identity_fp32/infer", header + b"\0" * 8, headers)
        for ep in clients.both()
    )
    _same_http("binary_short_for_shape", t, n)


@pytest.mark.parametrize(
    "outputs",
    [
        None,
        [{"name": "OUTPUT0"}],
        [
            {"name": "OUTPUT0", "parameters": {"foo": 1}},
            {"name": "OUTPUT1", "parameters": {"binary_data": True}},
        ],
        [{"name": "OUTPUT0", "parameters": {"classification": 3}}, {"name": "OUTPUT1"}],
        [{"name": "OUTPUT0", "parameters": {"classification": 3, "binary_data": True}}],
    ],
    ids=["no-outputs", "one-listed", "listed-one-asking", "classification", "classification-asking"],
)
def test_binary_data_output_reaches_only_unlisted_outputs(clients: Pair, outputs):
    """`binary_data_output: true` makes every output binary when the request lists none; a listed output is JSON
    unless it asks for binary data itself (a classification output too). Naiad applied it to listed outputs before."""
    body = {
        "inputs": [
            {"name": name, "datatype": "INT8", "shape": [1, 16], "data": list(range(16))}
            for name in ("INPUT0", "INPUT1")
        ],
        "parameters": {"binary_data_output": True},
    }
    if outputs is not None:
        body["outputs"] = outputs
    t, n = (http(ep, "POST", "/v2/models/simple_int8/infer", body) for ep in clients.both())
    assert t.status == 200, f"Triton changed: {t.describe()}"
    assert (n.status, n.body) == (t.status, t.body)
    assert n.headers.get("Inference-Header-Content-Length") == t.headers.get(
        "Inference-Header-Content-Length"
    )


def _repository_request(rpc: str, model: str, **params):
    from tritonclient.grpc import service_pb2 as pb

    req = getattr(pb, f"{rpc}Request")(model_name=model)
    for key, (kind, value) in params.items():
        setattr(req.parameters[key], kind, value)
    return req


REPOSITORY_GRPC_ERRORS = {
    "load_config_as_int": lambda: _repository_request(
        "RepositoryModelLoad", "simple_int8", config=("int64_param", 3)
    ),
    "load_file_as_text": lambda: _repository_request(
        "RepositoryModelLoad", "simple_int8", **{"file:1/model.py": ("string_param", "x")}
    ),
    "load_unknown_parameter": lambda: _repository_request(
        "RepositoryModelLoad", "simple_int8", foo=("string_param", "x")
    ),
    "unload_dependents_as_text": lambda: _repository_request(
        "RepositoryModelUnload", "nope", unload_dependents=("string_param", "x")
    ),
}


@pytest.mark.parametrize("case", list(REPOSITORY_GRPC_ERRORS))
def test_repository_parameters_over_grpc_in_triton_s_words(clients: Pair, case):
    """Load parameters of the wrong kind or unknown, unload_dependents not a bool: Triton's code and words, and
    nothing loaded or unloaded (Naiad took them before: an unknown load parameter was ignored)."""
    req = REPOSITORY_GRPC_ERRORS[case]()
    rpc = "RepositoryModelLoad" if "Load" in type(req).__name__ else "RepositoryModelUnload"
    t, n = (grpc_call(ep, rpc, req) for ep in clients.both())
    assert t.code.name == "INVALID_ARGUMENT", f"Triton changed: {t.describe()}"
    _same_grpc(case, t, n)


def test_repository_index_of_a_named_repository_over_grpc(clients: Pair):
    from tritonclient.grpc import service_pb2 as pb

    req = pb.RepositoryIndexRequest(repository_name="models", ready=True)
    t, n = (grpc_call(ep, "RepositoryIndex", req) for ep in clients.both())
    assert t.code.name == "UNIMPLEMENTED", f"Triton changed: {t.describe()}"
    _same_grpc("index_named_repository", t, n)


def test_explicit_int8_content_example(clients: Pair):
    t, n = (grpc_call(ep, "ModelInfer", _explicit_int8_request("")) for ep in clients.both())
    _same_grpc("explicit_int8", t, n)
    assert list(n.response.raw_output_contents) == list(t.response.raw_output_contents)
    total, diff = (np.frombuffer(raw, np.int8) for raw in n.response.raw_output_contents)
    assert total.tolist() == [i + 1 for i in range(16)] and diff.tolist() == [i - 1 for i in range(16)]
    t, n = (
        grpc_call(ep, "ModelInfer", _explicit_int8_request("wrong_specification")) for ep in clients.both()
    )
    _same_grpc("explicit_int8_wrong_version", t, n)
    # what the example itself checks
    assert "failed to get model version from specified version string 'wrong_specification'" in n.details


def test_int8_values_outside_the_type_s_range(clients: Pair):
    """INT8 values an int8 cannot hold, as gRPC int_contents and as HTTP JSON `data`: Triton casts them (300 is
    44, 2**31-1 is -1) and answers; Naiad answers INVALID_ARGUMENT / 400 naming the range (docs/triton-behaviour.md)."""
    values = [300, -200, 127, -128, 2**31 - 1, -(2**31)] + list(range(10))
    cast = np.array(values, np.int64).astype(np.int8)
    req = _explicit_int8_request("")
    req.inputs[0].contents.int_contents[:] = values
    t, n = (grpc_call(ep, "ModelInfer", req) for ep in clients.both())
    assert t.code.name == "OK"
    assert np.frombuffer(t.response.raw_output_contents[0], np.int8).tolist() == (cast + 1).tolist()
    assert n.code.name == "INVALID_ARGUMENT"
    assert n.details == "input 'INPUT0': a value of int_contents is out of range for INT8"
    body = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT8", "shape": [1, 16], "data": values},
            {"name": "INPUT1", "datatype": "INT8", "shape": [1, 16], "data": [1] * 16},
        ]
    }
    t, n = (http(ep, "POST", "/v2/models/simple_int8/infer", body) for ep in clients.both())
    assert t.status == 200
    assert json.loads(t.body)["outputs"][0]["data"] == (cast + 1).tolist()
    assert n.status == 400
    assert json.loads(n.body) == {"error": "unable to parse 'data': value out of range for INT8"}


@pytest.mark.parametrize("version", ["wrong_specification", "-1", "2abc", "99999999999999999999"])
@pytest.mark.parametrize("rpc", ["ModelMetadata", "ModelConfig", "ModelReady", "ModelStatistics"])
def test_version_string_on_per_model_rpcs(clients: Pair, rpc: str, version: str):
    from tritonclient.grpc import service_pb2 as pb

    req = getattr(pb, f"{rpc}Request")(name="simple_int8", version=version)
    t, n = (grpc_call(ep, rpc, req) for ep in clients.both())
    _same_grpc(f"version_{rpc}", t, n)
    if rpc == "ModelReady" and t.response is not None:
        assert n.response.ready == t.response.ready


@pytest.mark.parametrize("version", ["wrong_specification", "99999999999999999999", "01"])
@pytest.mark.parametrize("suffix", ["", "/ready", "/config", "/stats"])
def test_version_string_on_http_routes(clients: Pair, suffix: str, version: str):
    path = f"/v2/models/simple_int8/versions/{version}{suffix}"
    t, n = (http(ep, "GET", path) for ep in clients.both())
    _same_http(f"version_http{suffix}", t, n, same_body=t.status == 400)
