#!/usr/bin/env python3
"""Capture the exact behaviour of a real Triton (see docs/triton-behaviour.md).

Run with the oracle venv's interpreter (it needs tritonclient + grpcio):

    .venv-triton/bin/python tools/triton/probe.py [SCENARIO ...]

Each scenario starts its own real tritonserver on ports 18000-18002 (via
tests/triton_reference.py), sends raw HTTP requests (http.client, so status
line, headers and body are printed byte-exact) and raw gRPC calls (the
generated service stubs, so status codes and details are exact), and prints
markdown with fenced raw captures to stdout.

Scenarios: default, nonstrict, explicit, grpc, metrics (metrics also writes
docs/triton-metrics.txt). No scenario argument runs them all.
"""

from __future__ import annotations

import gzip
import http.client
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.triton_reference import TRITON_MODELS, tritonserver  # noqa: E402

HTTP, GRPC, METRICS = 18000, 18001, 18002


def section(title: str, level: int = 3) -> None:
    print(f"\n{'#' * level} {title}\n")


def fence(text: str, lang: str = "") -> None:
    print(f"```{lang}\n{text.rstrip()}\n```")


def raw_http(
    method: str,
    path: str,
    body: bytes | str | None = None,
    headers: dict | None = None,
    port: int = HTTP,
    show: bool = True,
    title: str | None = None,
) -> tuple[int, dict, bytes]:
    if isinstance(body, str):
        body = body.encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    hdrs = resp.getheaders()
    conn.close()
    if show:
        if title:
            print(f"\n{title}\n")
        req = f"{method} {path}"
        for k, v in (headers or {}).items():
            req += f"\n{k}: {v}"
        if body is not None:
            req += "\n\n" + _show_body(body)
        out = f"HTTP/1.1 {resp.status} {resp.reason}\n"
        out += "".join(f"{k}: {v}\n" for k, v in hdrs)
        out += "\n" + _show_body(data)
        fence(f"> {req}\n\n< " + out.replace("\n", "\n< ").rstrip("< ").rstrip())
    return resp.status, dict(hdrs), data


def _show_body(data: bytes) -> str:
    try:
        text = data.decode("utf-8")
        if text.isprintable() or all(c.isprintable() or c in "\n\t" for c in text):
            return text
    except UnicodeDecodeError:
        pass
    return "(binary, python repr) " + repr(data)


def jpost(path: str, obj, title: str | None = None, **kw):
    return raw_http("POST", path, json.dumps(obj, separators=(",", ":")), title=title, **kw)


def infer_traffic() -> None:
    """A few successful inferences so statistics/metrics have content."""
    for _ in range(3):
        raw_http(
            "POST",
            "/v2/models/identity_fp32/infer",
            json.dumps(
                {
                    "inputs": [
                        {"name": "INPUT0", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}
                    ]
                }
            ),
            show=False,
        )
    raw_http(
        "POST",
        "/v2/models/identity_batched/infer",
        json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}),
        show=False,
    )
    # one failure (wrong dtype)
    raw_http(
        "POST",
        "/v2/models/identity_fp32/infer",
        json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "INT32", "data": [1]}]}),
        show=False,
    )


def wait_model_ready(name: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st, _, _ = raw_http("GET", f"/v2/models/{name}/ready", show=False)
        if st == 200:
            return
        time.sleep(0.2)


# --------------------------------------------------------------------------
# Scenario: default mode (MODE_NONE, strict readiness, broken model present)
# --------------------------------------------------------------------------
def scenario_default() -> None:
    section("Scenario `default`: MODE_NONE, --exit-on-error=false, strict readiness (default)", 2)
    with tritonserver(TRITON_MODELS, HTTP, GRPC, METRICS, ["--exit-on-error=false"], wait_for="live"):
        section("Server metadata and health")
        raw_http("GET", "/v2")
        raw_http("GET", "/v2/health/live")
        raw_http("GET", "/v2/health/ready")
        raw_http("HEAD", "/v2/health/live")
        raw_http("POST", "/v2/health/live", "")
        raw_http("GET", "/v2/")
        raw_http("GET", "/v2/nonexistent")
        raw_http("GET", "/")

        section("Model metadata")
        for m in ["identity_fp32", "add_sub", "identity_bytes", "identity_batched"]:
            raw_http("GET", f"/v2/models/{m}")
        raw_http("GET", "/v2/models/identity_fp32/versions/1")
        raw_http("GET", "/v2/models/identity_fp32/versions/2")
        raw_http("GET", "/v2/models/identity_fp32/versions/abc")
        raw_http("GET", "/v2/models/identity_fp32/versions/0")
        raw_http("GET", "/v2/models/broken")
        raw_http("GET", "/v2/models/broken/versions/1")
        raw_http("GET", "/v2/models/nope")
        raw_http("GET", "/v2/models/nope/versions/1")

        section("Model ready")
        raw_http("GET", "/v2/models/identity_fp32/ready")
        raw_http("GET", "/v2/models/identity_fp32/versions/1/ready")
        raw_http("GET", "/v2/models/identity_fp32/versions/2/ready")
        raw_http("GET", "/v2/models/identity_fp32/versions/abc/ready")
        raw_http("GET", "/v2/models/broken/ready")
        raw_http("GET", "/v2/models/nope/ready")

        section("Model config")
        for m in ["identity_fp32", "add_sub", "identity_bytes", "identity_batched"]:
            raw_http("GET", f"/v2/models/{m}/config")
        raw_http("GET", "/v2/models/identity_fp32/versions/1/config")
        raw_http("GET", "/v2/models/identity_fp32/versions/2/config")
        raw_http("GET", "/v2/models/broken/config")
        raw_http("GET", "/v2/models/nope/config")

        section("Infer: success (JSON)")
        base = "/v2/models/identity_fp32/infer"
        inp = {"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2.5, 3]}
        jpost(base, {"inputs": [inp]})
        jpost(
            base,
            {
                "id": "req-42",
                "parameters": {"foo": "bar", "n": 3},
                "inputs": [inp],
                "outputs": [{"name": "OUTPUT0"}],
            },
            title="With `id`, request `parameters` and explicit `outputs`:",
        )
        jpost(
            base,
            {"inputs": [{"name": "INPUT0", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3, 4]]}]},
            title="Nested `data` (row-major nested lists):",
        )
        jpost("/v2/models/identity_fp32/versions/1/infer", {"inputs": [inp]}, title="Explicit version:")
        jpost(
            "/v2/models/add_sub/infer",
            {
                "inputs": [
                    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": list(range(16))},
                    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": [1] * 16},
                ]
            },
        )
        jpost(
            "/v2/models/add_sub/infer",
            {
                "inputs": [
                    {"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": list(range(16))},
                    {"name": "INPUT1", "shape": [16], "datatype": "FP32", "data": [1] * 16},
                ],
                "outputs": [{"name": "OUTPUT1"}],
            },
            title="Only OUTPUT1 requested:",
        )
        jpost(
            "/v2/models/identity_bytes/infer",
            {"inputs": [{"name": "INPUT0", "shape": [3], "datatype": "BYTES", "data": ["abc", "", "héllo"]}]},
        )
        jpost(
            "/v2/models/identity_batched/infer",
            {"inputs": [{"name": "INPUT0", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
        )

        jpost(
            base,
            {
                "inputs": [
                    {
                        "name": "INPUT0",
                        "shape": [1, 8],
                        "datatype": "FP32",
                        "data": [0.1, 1e-7, 16777217, 3.4e38, -0.0, 1e-45, 123456.789, 2],
                    }
                ]
            },
            title="FP32 number formatting in JSON output:",
        )
        jpost(base, {"inputs": [{**inp, "data": [1, True, 3]}]}, title="JSON `true` in FP32 `data`:")
        jpost(
            base,
            {"inputs": [inp], "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 2}}]},
            title="Classification extension (`classification: 2` on the output):",
        )
        jpost(
            "/v2/models/identity_fp32/versions/0/infer", {"inputs": [inp]}, title="Version `0` in the path:"
        )
        jpost(
            "/v2/models/identity_fp32/versions/-1/infer", {"inputs": [inp]}, title="Version `-1` in the path:"
        )
        jpost("/v2/models/identity_fp32/versions//infer", {"inputs": [inp]}, title="Empty version segment:")
        body = json.dumps({"inputs": [inp]}, separators=(",", ":"))
        raw_http(
            "POST",
            base,
            gzip.compress(body.encode()),
            {"Content-Encoding": "gzip"},
            title="gzip-compressed request body (`Content-Encoding: gzip`):",
        )
        raw_http(
            "POST",
            base,
            body,
            {"Accept-Encoding": "gzip"},
            title="`Accept-Encoding: gzip` (response compression):",
        )

        section("Infer: binary tensor data")
        jpost(
            base,
            {"inputs": [inp], "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]},
            title="Output with `binary_data: true`:",
        )
        jpost(
            base,
            {"inputs": [inp], "parameters": {"binary_data_output": True}},
            title="Request parameter `binary_data_output: true` (no `outputs`):",
        )
        hdr = json.dumps(
            {
                "inputs": [
                    {
                        "name": "INPUT0",
                        "shape": [1, 3],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": 12},
                    }
                ]
            },
            separators=(",", ":"),
        ).encode()
        raw_http(
            "POST",
            base,
            hdr + struct.pack("<3f", 1, 2, 3),
            {"Inference-Header-Content-Length": str(len(hdr)), "Content-Type": "application/octet-stream"},
            title="Binary input, JSON output:",
        )
        raw_http(
            "POST",
            base,
            hdr + struct.pack("<3f", 1, 2, 3),
            {"Inference-Header-Content-Length": str(len(hdr))},
            title="Binary input without Content-Type header:",
        )
        jpost(
            "/v2/models/identity_bytes/infer",
            {
                "inputs": [{"name": "INPUT0", "shape": [2], "datatype": "BYTES", "data": ["abc", "de"]}],
                "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
            },
            title="BYTES output as binary (4-byte little-endian length prefix per element):",
        )
        bhdr = json.dumps(
            {
                "inputs": [
                    {
                        "name": "INPUT0",
                        "shape": [2],
                        "datatype": "BYTES",
                        "parameters": {"binary_data_size": 13},
                    }
                ]
            },
            separators=(",", ":"),
        ).encode()
        raw_http(
            "POST",
            "/v2/models/identity_bytes/infer",
            bhdr + struct.pack("<I", 3) + b"abc" + struct.pack("<I", 2) + b"de",
            {"Inference-Header-Content-Length": str(len(bhdr))},
            title="BYTES binary input, JSON output:",
        )
        jpost(
            base,
            {
                "inputs": [inp],
                "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}],
                "parameters": {"binary_data_output": True},
            },
            title="`binary_data_output: true` but output says `binary_data: false`:",
        )

        section("Infer: errors")
        cases = [
            ("Unknown model", "/v2/models/nope/infer", {"inputs": [inp]}),
            ("Unknown version", "/v2/models/identity_fp32/versions/7/infer", {"inputs": [inp]}),
            ("Non-numeric version", "/v2/models/identity_fp32/versions/abc/infer", {"inputs": [inp]}),
            (
                "Model failed to load",
                "/v2/models/broken/infer",
                {"inputs": [{"name": "INPUT0", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]},
            ),
            (
                "Wrong datatype (INT32 for FP32)",
                base,
                {"inputs": [{**inp, "datatype": "INT32", "data": [1, 2, 3]}]},
            ),
            (
                "Wrong datatype, request with an `id`",
                base,
                {"id": "my-req", "inputs": [{**inp, "datatype": "INT32", "data": [1, 2, 3]}]},
            ),
            ("Invalid datatype string", base, {"inputs": [{**inp, "datatype": "FLOAT"}]}),
            (
                "Wrong shape: batch dim missing (shape [3] on max_batch_size 8)",
                base,
                {"inputs": [{**inp, "shape": [3]}]},
            ),
            (
                "Wrong shape: add_sub shape [15]",
                "/v2/models/add_sub/infer",
                {
                    "inputs": [
                        {"name": "INPUT0", "shape": [15], "datatype": "FP32", "data": [0] * 15},
                        {"name": "INPUT1", "shape": [15], "datatype": "FP32", "data": [0] * 15},
                    ]
                },
            ),
            (
                "Wrong shape: add_sub shape [1,16] (extra dim)",
                "/v2/models/add_sub/infer",
                {
                    "inputs": [
                        {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0] * 16},
                        {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": [0] * 16},
                    ]
                },
            ),
            (
                "Missing input (add_sub without INPUT1)",
                "/v2/models/add_sub/infer",
                {"inputs": [{"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": [0] * 16}]},
            ),
            ("Unexpected extra input", base, {"inputs": [inp, {**inp, "name": "INPUT1"}]}),
            ("Duplicate input", base, {"inputs": [inp, inp]}),
            (
                "Batch size above max_batch_size (9 > 8)",
                base,
                {"inputs": [{**inp, "shape": [9, 1], "data": [0] * 9}]},
            ),
            (
                "Batch size above max_batch_size on dynamic batcher (17 > 16)",
                "/v2/models/identity_batched/infer",
                {"inputs": [{**inp, "shape": [17, 1], "data": [0] * 17}]},
            ),
            ("Unknown requested output", base, {"inputs": [inp], "outputs": [{"name": "OUTPUT9"}]}),
            ("`data` has fewer elements than shape", base, {"inputs": [{**inp, "shape": [1, 4]}]}),
            ("`data` has more elements than shape", base, {"inputs": [{**inp, "shape": [1, 2]}]}),
            (
                "`data` element of wrong JSON type (string for FP32)",
                base,
                {"inputs": [{**inp, "data": ["a", "b", "c"]}]},
            ),
            ("No `inputs` key", base, {}),
            ("Empty `inputs` list", base, {"inputs": []}),
            (
                "Input without `data` and without binary_data_size",
                base,
                {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32"}]},
            ),
            (
                "Input without `shape`",
                base,
                {"inputs": [{"name": "INPUT0", "datatype": "FP32", "data": [1, 2, 3]}]},
            ),
            ("Negative dim in request shape", base, {"inputs": [{**inp, "shape": [1, -1]}]}),
        ]
        for title, path, obj in cases:
            jpost(path, obj, title=f"{title}:")
        raw_http("POST", base, "{not json", title="Malformed JSON body:")
        raw_http("POST", base, "", title="Empty body:")
        raw_http("POST", base, "[1,2,3]", title="JSON that is not an object:")
        raw_http(
            "POST",
            base,
            hdr + struct.pack("<3f", 1, 2, 3),
            {"Inference-Header-Content-Length": str(len(hdr) + 100)},
            title="Inference-Header-Content-Length larger than the body:",
        )
        raw_http(
            "POST",
            base,
            hdr + struct.pack("<2f", 1, 2),
            {"Inference-Header-Content-Length": str(len(hdr))},
            title="binary_data_size (12) larger than the binary part (8 bytes):",
        )
        raw_http(
            "POST",
            base,
            hdr + struct.pack("<4f", 1, 2, 3, 4),
            {"Inference-Header-Content-Length": str(len(hdr))},
            title="Binary part longer than binary_data_size (16 bytes sent, 12 declared):",
        )
        hdr8 = hdr.replace(b'"binary_data_size":12', b'"binary_data_size":8')
        raw_http(
            "POST",
            base,
            hdr8 + struct.pack("<2f", 1, 2),
            {"Inference-Header-Content-Length": str(len(hdr8))},
            title="binary_data_size (8) consistent with body but not with shape [1,3]:",
        )
        raw_http(
            "POST",
            base,
            hdr + struct.pack("<3f", 1, 2, 3),
            {"Inference-Header-Content-Length": "abc"},
            title="Non-numeric Inference-Header-Content-Length:",
        )
        raw_http(
            "POST",
            base,
            struct.pack("<3f", 1, 2, 3),
            {"Inference-Header-Content-Length": "0"},
            title="Raw binary request (Inference-Header-Content-Length: 0, body = 12 raw bytes):",
        )
        raw_http(
            "POST",
            "/v2/models/add_sub/infer",
            struct.pack("<3f", 1, 2, 3),
            {"Inference-Header-Content-Length": "0"},
            title="Raw binary request to a two-input model (add_sub):",
        )
        raw_http("GET", base, title="GET on the infer endpoint:")

        section("Statistics (after a few inferences)")
        infer_traffic()
        raw_http("GET", "/v2/models/stats")
        raw_http("GET", "/v2/models/identity_fp32/stats")
        raw_http("GET", "/v2/models/identity_fp32/versions/1/stats")
        raw_http("GET", "/v2/models/identity_fp32/versions/2/stats")
        raw_http("GET", "/v2/models/broken/stats")
        raw_http("GET", "/v2/models/nope/stats")

        section("Logging, trace, shared memory")
        raw_http("GET", "/v2/logging")
        jpost("/v2/logging", {"log_verbose_level": 1}, title="Update logging:")
        jpost("/v2/logging", {"log_verbose_level": "x"}, title="Update logging with a bad value:")
        jpost("/v2/logging", {"log_verbose_level": 0}, show=False)
        raw_http("GET", "/v2/trace/setting")
        raw_http("GET", "/v2/models/identity_fp32/trace/setting")
        raw_http("GET", "/v2/models/nope/trace/setting")
        raw_http("GET", "/v2/systemsharedmemory/status")
        raw_http("GET", "/v2/cudasharedmemory/status")

        section("Repository API in MODE_NONE")
        jpost("/v2/repository/index", {})
        jpost("/v2/repository/models/identity_fp32/load", {})
        jpost("/v2/repository/models/identity_fp32/unload", {})


def scenario_nonstrict() -> None:
    section("Scenario `nonstrict`: --strict-readiness=false, broken model present", 2)
    with tritonserver(
        TRITON_MODELS, HTTP, GRPC, METRICS, ["--exit-on-error=false", "--strict-readiness=false"]
    ):
        raw_http("GET", "/v2/health/live")
        raw_http("GET", "/v2/health/ready")
        raw_http("GET", "/v2/models/broken/ready")
    section("Scenario `exit-on-error`: default flags with a broken model", 2)
    log = Path(tempfile.mkdtemp()) / "triton.log"
    try:
        with tritonserver(TRITON_MODELS, HTTP, GRPC, METRICS, log_path=log, timeout=30):
            print("server became ready (unexpected)")
    except RuntimeError as exc:
        lines = str(exc).strip().splitlines()
        fence("\n".join([lines[0]] + [ln for ln in lines if "error:" in ln]))


def scenario_explicit() -> None:
    section("Scenario `explicit`: --model-control-mode=explicit --load-model=identity_fp32", 2)
    with tritonserver(
        TRITON_MODELS, HTTP, GRPC, METRICS, ["--model-control-mode=explicit", "--load-model=identity_fp32"]
    ):
        raw_http("GET", "/v2")
        raw_http("GET", "/v2/health/ready")
        jpost("/v2/repository/index", {}, title="Index, no filter:")
        raw_http("POST", "/v2/repository/index", "", title="Index, empty body:")
        jpost("/v2/repository/index", {"ready": True}, title="Index, ready=true:")
        jpost("/v2/repository/index", {"ready": False}, title="Index, ready=false:")
        raw_http("GET", "/v2/repository/index", title="GET on index:")
        jpost("/v2/repository/models/add_sub/load", {}, title="Load add_sub:")
        raw_http("POST", "/v2/repository/models/identity_bytes/load", "", title="Load with empty body:")
        jpost("/v2/repository/models/add_sub/load", {}, title="Load add_sub again (already loaded):")
        jpost("/v2/repository/models/nope/load", {}, title="Load unknown model:")
        jpost("/v2/repository/models/broken/load", {}, title="Load broken model:")
        raw_http("GET", "/v2/health/ready", title="Server ready after failed load:")
        jpost("/v2/repository/index", {}, title="Index after loads:")
        jpost("/v2/repository/index", {"ready": True}, title="Index ready=true after loads:")
        jpost("/v2/repository/index", {"ready": False}, title="Index ready=false after loads:")
        jpost("/v2/repository/models/identity_fp32/unload", {}, title="Unload identity_fp32:")
        jpost("/v2/repository/index", {}, title="Index immediately after the unload call returned:")
        time.sleep(2)
        raw_http("GET", "/v2/models/identity_fp32", title="Metadata after unload:")
        raw_http("GET", "/v2/models/identity_fp32/ready", title="Ready after unload:")
        raw_http("GET", "/v2/models/identity_fp32/config", title="Config after unload:")
        jpost(
            "/v2/models/identity_fp32/infer",
            {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]},
            title="Infer after unload:",
        )
        raw_http("GET", "/v2/models/identity_fp32/stats", title="Stats after unload:")
        jpost("/v2/repository/index", {}, title="Index after unload:")
        jpost("/v2/repository/models/identity_fp32/unload", {}, title="Unload again (already unloaded):")
        jpost("/v2/repository/models/nope/unload", {}, title="Unload unknown model:")
        jpost(
            "/v2/repository/models/add_sub/unload",
            {"parameters": {"unload_dependents": True}},
            title="Unload with unload_dependents:",
        )
        cfg = {
            "name": "identity_fp32",
            "backend": "python",
            "max_batch_size": 4,
            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        }
        jpost(
            "/v2/repository/models/identity_fp32/load",
            {"parameters": {"config": json.dumps(cfg)}},
            title="Load with a `config` override (max_batch_size 4):",
        )
        wait_model_ready("identity_fp32")
        raw_http("GET", "/v2/models/identity_fp32/config", title="Config after override load:")
        jpost(
            "/v2/models/identity_fp32/infer",
            {"inputs": [{"name": "INPUT0", "shape": [5, 1], "datatype": "FP32", "data": [1] * 5}]},
            title="Infer with batch 5 after override:",
        )
        jpost(
            "/v2/repository/models/identity_fp32/load",
            {"parameters": {"config": "{not json"}},
            title="Load with an invalid JSON `config`:",
        )
        jpost(
            "/v2/repository/models/identity_fp32/load",
            {"parameters": {"config": {"max_batch_size": 2}}},
            title="Load with `config` as an object instead of a string:",
        )
        jpost(
            "/v2/repository/models/identity_fp32/load",
            {"parameters": {"config": json.dumps({**cfg, "name": "other"})}},
            title="Load with `config` whose name differs:",
        )
        raw_http(
            "POST", "/v2/repository/models/identity_fp32/load", "{bad", title="Load with malformed JSON body:"
        )
        raw_http("GET", "/v2/health/ready", title="Server ready at the end:")


def scenario_metrics() -> None:
    section("Scenario `metrics`", 2)
    with tritonserver(TRITON_MODELS, HTTP, GRPC, METRICS, ["--exit-on-error=false"], wait_for="live"):
        infer_traffic()
        time.sleep(3)  # CPU metrics are sampled every --metrics-interval-ms (2000)
        st, hdrs, body = raw_http("GET", "/metrics", port=METRICS, show=False)
        print(f"`GET /metrics` on the metrics port: HTTP {st}, headers {json.dumps(hdrs)}")
        (REPO / "docs").mkdir(exist_ok=True)
        (REPO / "docs" / "triton-metrics.txt").write_bytes(body)
        st2, _, _ = raw_http("GET", "/metrics", port=HTTP, show=False)
        print(f"\n`GET /metrics` on the HTTP port: HTTP {st2}")
        raw_http("GET", "/", port=METRICS, title="`GET /` on the metrics port:")


def scenario_grpc() -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    section("Scenario `grpc`: MODE_NONE, --exit-on-error=false", 2)
    with tritonserver(TRITON_MODELS, HTTP, GRPC, METRICS, ["--exit-on-error=false"], wait_for="live"):
        ch = grpc.insecure_channel(f"127.0.0.1:{GRPC}")
        stub = pbg.GRPCInferenceServiceStub(ch)

        def call(rpc: str, req, title: str | None = None) -> None:
            if title:
                print(f"\n{title}\n")
            text = f"> {rpc}({type(req).__name__}) {{{str(req).strip()}}}\n\n"
            try:
                resp, c = getattr(stub, rpc).with_call(req, timeout=30)
                text += f"< OK\n< trailing metadata: {list(c.trailing_metadata() or [])}\n"
                body = str(resp)
                text += body if len(body) < 6000 else body[:6000] + "\n... (truncated)"
            except grpc.RpcError as e:
                text += f"< {e.code()}\n< details: {e.details()!r}"
            fence(text)

        section("Health and metadata")
        call("ServerLive", pb.ServerLiveRequest())
        call("ServerReady", pb.ServerReadyRequest())
        call("ServerMetadata", pb.ServerMetadataRequest())
        call("ModelReady", pb.ModelReadyRequest(name="identity_fp32"))
        call("ModelReady", pb.ModelReadyRequest(name="broken"))
        call("ModelReady", pb.ModelReadyRequest(name="nope"))
        call("ModelReady", pb.ModelReadyRequest(name="identity_fp32", version="2"))
        call("ModelMetadata", pb.ModelMetadataRequest(name="identity_fp32"))
        call("ModelMetadata", pb.ModelMetadataRequest(name="add_sub", version="1"))
        call("ModelMetadata", pb.ModelMetadataRequest(name="nope"))
        call("ModelMetadata", pb.ModelMetadataRequest(name="broken"))
        call("ModelMetadata", pb.ModelMetadataRequest(name="identity_fp32", version="2"))
        call("ModelMetadata", pb.ModelMetadataRequest(name="identity_fp32", version="abc"))
        section("Model config")
        call("ModelConfig", pb.ModelConfigRequest(name="identity_fp32"))
        call("ModelConfig", pb.ModelConfigRequest(name="identity_batched"))
        call("ModelConfig", pb.ModelConfigRequest(name="identity_bytes"))
        call("ModelConfig", pb.ModelConfigRequest(name="broken"))
        call("ModelConfig", pb.ModelConfigRequest(name="nope"))

        def t(name, dt, shape, contents=None, raw=None):
            x = pb.ModelInferRequest.InferInputTensor(name=name, datatype=dt, shape=shape)
            if contents:
                for k, v in contents.items():
                    getattr(x.contents, k).extend(v)
            return x, raw

        def req(model, inputs, version="", outputs=(), rid="", params=None):
            r = pb.ModelInferRequest(model_name=model, model_version=version, id=rid)
            for x, raw in inputs:
                r.inputs.append(x)
                if raw is not None:
                    r.raw_input_contents.append(raw)
            for o in outputs:
                r.outputs.append(pb.ModelInferRequest.InferRequestedOutputTensor(name=o))
            for k, v in (params or {}).items():
                r.parameters[k].string_param = v
            return r

        ok_in = t("INPUT0", "FP32", [1, 3], {"fp32_contents": [1, 2.5, 3]})
        section("Infer")
        call("ModelInfer", req("identity_fp32", [ok_in]), "Success, typed contents:")
        call(
            "ModelInfer",
            req("identity_fp32", [ok_in], rid="req-42", params={"foo": "bar"}),
            "With id and a parameter:",
        )
        call(
            "ModelInfer",
            req("identity_fp32", [t("INPUT0", "FP32", [1, 3], raw=struct.pack("<3f", 1, 2, 3))]),
            "Success, raw_input_contents (responses always use raw_output_contents):",
        )
        call(
            "ModelInfer",
            req("identity_bytes", [t("INPUT0", "BYTES", [2], {"bytes_contents": [b"abc", b"de"]})]),
            "BYTES:",
        )
        section("Infer errors")
        errs = [
            ("Unknown model", req("nope", [ok_in])),
            ("Unknown version", req("identity_fp32", [ok_in], version="7")),
            ("Non-numeric version", req("identity_fp32", [ok_in], version="abc")),
            ("Model failed to load", req("broken", [t("INPUT0", "FP32", [3], {"fp32_contents": [1, 2, 3]})])),
            (
                "Wrong datatype",
                req("identity_fp32", [t("INPUT0", "INT32", [1, 3], {"int_contents": [1, 2, 3]})]),
            ),
            (
                "Wrong datatype, request with an id",
                req(
                    "identity_fp32", [t("INPUT0", "INT32", [1, 3], {"int_contents": [1, 2, 3]})], rid="my-req"
                ),
            ),
            (
                "Wrong shape (batch dim missing)",
                req("identity_fp32", [t("INPUT0", "FP32", [3], {"fp32_contents": [1, 2, 3]})]),
            ),
            ("Missing input", req("add_sub", [t("INPUT0", "FP32", [16], {"fp32_contents": [0] * 16})])),
            (
                "Unexpected extra input",
                req("identity_fp32", [ok_in, t("INPUT1", "FP32", [1, 3], {"fp32_contents": [1, 2, 3]})]),
            ),
            (
                "Batch size above max_batch_size",
                req("identity_fp32", [t("INPUT0", "FP32", [9, 1], {"fp32_contents": [0] * 9})]),
            ),
            ("Unknown requested output", req("identity_fp32", [ok_in], outputs=["OUTPUT9"])),
            (
                "Contents length not matching shape",
                req("identity_fp32", [t("INPUT0", "FP32", [1, 4], {"fp32_contents": [1, 2, 3]})]),
            ),
            (
                "Raw contents length not matching shape",
                req("identity_fp32", [t("INPUT0", "FP32", [1, 4], raw=struct.pack("<3f", 1, 2, 3))]),
            ),
            ("Input with neither contents nor raw", req("identity_fp32", [t("INPUT0", "FP32", [1, 3])])),
            (
                "Both typed contents and raw_input_contents",
                req(
                    "identity_fp32",
                    [
                        t(
                            "INPUT0",
                            "FP32",
                            [1, 3],
                            {"fp32_contents": [1, 2, 3]},
                            raw=struct.pack("<3f", 1, 2, 3),
                        )
                    ],
                ),
            ),
        ]
        for title, r in errs:
            call("ModelInfer", r, f"{title}:")

        section("Statistics")
        infer_traffic()
        call("ModelStatistics", pb.ModelStatisticsRequest(name="identity_fp32"))
        call("ModelStatistics", pb.ModelStatisticsRequest(name="nope"))
        section("Repository (MODE_NONE)")
        call("RepositoryIndex", pb.RepositoryIndexRequest())
        call("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="identity_fp32"))
        section("Logging / trace")
        call("LogSettings", pb.LogSettingsRequest())
        call("TraceSetting", pb.TraceSettingRequest())
        ch.close()

    section("gRPC repository API with --model-control-mode=explicit", 3)
    with tritonserver(
        TRITON_MODELS, HTTP, GRPC, METRICS, ["--model-control-mode=explicit", "--load-model=identity_fp32"]
    ):
        ch = grpc.insecure_channel(f"127.0.0.1:{GRPC}")
        stub = pbg.GRPCInferenceServiceStub(ch)
        call("RepositoryIndex", pb.RepositoryIndexRequest())
        call("RepositoryIndex", pb.RepositoryIndexRequest(ready=True))
        call("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="add_sub"))
        call("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="nope"))
        call("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="broken"))
        call("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="add_sub"))
        call("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="nope"))
        time.sleep(1)
        call("ModelMetadata", pb.ModelMetadataRequest(name="add_sub"), "Metadata after unload:")
        call("ModelReady", pb.ModelReadyRequest(name="add_sub"), "Ready after unload:")
        call("RepositoryIndex", pb.RepositoryIndexRequest(), "Index after unload:")
        ch.close()


SCENARIOS = {
    "default": scenario_default,
    "nonstrict": scenario_nonstrict,
    "explicit": scenario_explicit,
    "grpc": scenario_grpc,
    "metrics": scenario_metrics,
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(SCENARIOS)
    for n in names:
        SCENARIOS[n]()
        sys.stdout.flush()
