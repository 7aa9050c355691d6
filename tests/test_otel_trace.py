"""OpenTelemetry trace mode against a real OpenTelemetry Collector (tools/go/otelcol: OTLP receiver, file exporter).

A live `naiad serve` exports over OTLP/HTTP (and OTLP/gRPC); the collector writes what it received to a file that
the tests read back: span names, parentage, event order, attributes, resource, traceparent propagation.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from helpers import NaiadProcess, free_ports, go_tool

BLS_MODEL = '''
import json
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """BLS with the trace handed on: add_sub runs as a child of this request's span."""

    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = [
                pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                pb_utils.get_input_tensor_by_name(request, "INPUT1"),
            ]
            result = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT0"], inputs=inputs, trace=request.trace()
            ).exec()
            if result.has_error():
                raise pb_utils.TritonModelException(result.error().message())
            context = request.trace().get_context() or "null"
            out = pb_utils.get_output_tensor_by_name(result, "OUTPUT0").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", out), pb_utils.Tensor("CONTEXT", np.array([context], dtype=object))]
                )
            )
        return responses
'''

BLS_CONFIG = """
name: "{name}"
backend: "python"
input [
  {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "CONTEXT" data_type: TYPE_STRING dims: [ 1 ] }}
]
parameters {{ key: "EXECUTION_ISOLATION" value: {{ string_value: "{isolation}" }} }}
"""

COLLECTOR_CONFIG = """
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{http}
      grpc:
        endpoint: 127.0.0.1:{grpc}
exporters:
  file:
    path: {path}
    flush_interval: 100ms
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [file]
"""

FAILING_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise pb_utils.TritonModelException("this model always fails")
"""

FAILING_CONFIG = """
name: "failing"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

LOADED = [
    "failing",
    "repeat",
    "identity_fp32",
    "add_sub",
    "bls_traced",
    "bls_traced_process",
    "ensemble_mlp",
    "mlp_onnx",
    "scale_python",
]


class Collector:
    def __init__(self, binary: Path, workdir: Path):
        self.http_port, self.grpc_port = free_ports(2)
        self.path = workdir / "spans.jsonl"
        self.config = workdir / "collector.yaml"
        self.config.write_text(
            COLLECTOR_CONFIG.format(http=self.http_port, grpc=self.grpc_port, path=self.path)
        )
        self.log = open(workdir / "collector.log", "wb")
        self.proc = subprocess.Popen(
            [str(binary), "--config", str(self.config)], stdout=self.log, stderr=self.log
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (workdir / "collector.log").read_text()
            try:
                requests.post(f"http://127.0.0.1:{self.http_port}/v1/traces", json={}, timeout=1)
                return
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError("the collector did not start: " + (workdir / "collector.log").read_text())

    def spans(self) -> list[dict]:
        """Every span received so far, each with its resource's attributes under `resource`."""
        out = []
        if not self.path.exists():
            return out
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            for rs in json.loads(line).get("resourceSpans", []):
                resource = _attrs(rs.get("resource", {}).get("attributes", []))
                for ss in rs.get("scopeSpans", []):
                    for span in ss.get("spans", []):
                        out.append({**span, "resource": resource})
        return out

    def trace(self, trace_id: str, count: int, timeout: float = 20.0) -> list[dict]:
        """The spans of one trace, once `count` of them have arrived."""
        deadline = time.monotonic() + timeout
        while True:
            spans = [s for s in self.spans() if s["traceId"] == trace_id]
            if len(spans) >= count or time.monotonic() > deadline:
                return spans
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _attrs(items: list[dict]) -> dict:
    return {a["key"]: next(iter(a["value"].values()), None) for a in items}


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    binary = go_tool("otelcol")
    assert binary is not None, "the OpenTelemetry Collector (tools/go/otelcol) could not be built"
    c = Collector(binary, tmp_path_factory.mktemp("otelcol"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def traced_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("traced")
    for name, isolation in (("bls_traced", "thread"), ("bls_traced_process", "process")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text("import numpy as np\n" + BLS_MODEL)
        (repo / name / "config.pbtxt").write_text(BLS_CONFIG.format(name=name, isolation=isolation))
    (repo / "failing" / "1").mkdir(parents=True)
    (repo / "failing" / "1" / "model.py").write_text(FAILING_MODEL)
    (repo / "failing" / "config.pbtxt").write_text(FAILING_CONFIG)
    return repo


def _serve(model_repo, traced_repo, collector, *extra: str) -> NaiadProcess:
    args = ["--model-control-mode", "explicit", "--strict-readiness", "false"]
    for m in LOADED:
        args += ["--load-model", m]
    return NaiadProcess([model_repo, traced_repo], *args, *extra).start()


@pytest.fixture(scope="module")
def server(model_repo, traced_repo, collector):
    proc = _serve(
        model_repo,
        traced_repo,
        collector,
        "--trace-config",
        "mode=opentelemetry",
        "--trace-config",
        "level=TIMESTAMPS",
        "--trace-config",
        "rate=1",
        "--trace-config",
        f"opentelemetry,url=http://127.0.0.1:{collector.http_port}/v1/traces",
        "--trace-config",
        "opentelemetry,resource=service.name=naiad-under-test",
        "--trace-config",
        "opentelemetry,resource=test.key=test.value",
        "--trace-config",
        "opentelemetry,bsp_schedule_delay=50",
    )
    yield proc
    proc.stop()


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _by_name(spans: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in spans:
        out.setdefault(s["name"], []).append(s)
    return out


def _children(spans: list[dict]) -> dict[str, list[str]]:
    """{parent span name: sorted child span names}, as Triton's own trace test compares them."""
    names = {s["spanId"]: s["name"] for s in spans}
    out: dict[str, list[str]] = {}
    for s in spans:
        if s.get("parentSpanId") in names:
            out.setdefault(names[s["parentSpanId"]], []).append(s["name"])
    return {k: sorted(v) for k, v in out.items()}


def _events(span: dict) -> list[tuple[str, int]]:
    return [(e["name"], int(e["timeUnixNano"])) for e in span.get("events", [])]


def _check_request_spans(spans: list[dict], model: str, parent_span_id: str | None) -> None:
    """InferRequest -> <model> -> compute, with Triton's events in time order inside their spans."""
    by = _by_name(spans)
    root, span, compute = by["InferRequest"][0], by[model][0], by["compute"][0]
    assert root.get("parentSpanId", "") == (parent_span_id or "")
    assert span["parentSpanId"] == root["spanId"] and compute["parentSpanId"] == span["spanId"]
    assert root["kind"] in (2, "SPAN_KIND_SERVER")
    attrs = _attrs(span["attributes"])
    assert attrs["model_name"] == model and attrs["model_version"] == "1"
    assert span["resource"]["service.name"] == "naiad-under-test"
    assert span["resource"]["test.key"] == "test.value"

    events = _events(span)
    assert [n for n, _ in events] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    compute_events = _events(compute)
    assert [n for n, _ in compute_events] == [
        "COMPUTE_START",
        "COMPUTE_INPUT_END",
        "COMPUTE_OUTPUT_START",
        "COMPUTE_END",
    ]
    times = [t for _, t in events]
    ctimes = [t for _, t in compute_events]
    assert times == sorted(times) and ctimes == sorted(ctimes)
    # QUEUE_START <= COMPUTE_START, COMPUTE_END <= REQUEST_END, all inside the spans' own bounds
    assert times[1] <= ctimes[0] and ctimes[-1] <= times[2]
    start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
    assert start == times[0] and end == times[2]
    assert int(compute["startTimeUnixNano"]) == ctimes[0] and int(compute["endTimeUnixNano"]) == ctimes[-1]
    assert int(root["startTimeUnixNano"]) <= start and end <= int(root["endTimeUnixNano"])
    assert abs(start / 1e9 - time.time()) < 120  # wall-clock time, not a monotonic clock


def _identity_http(server, headers=None):
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(server.http) as client:
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        return client.infer("identity_fp32", [inp], headers=headers)


def test_http_traceparent_makes_server_spans_children(server, collector):
    header, trace_id, span_id = _traceparent()
    _identity_http(server, {"traceparent": header})
    spans = collector.trace(trace_id, 3)
    assert sorted(s["name"] for s in spans) == ["InferRequest", "compute", "identity_fp32"], spans
    _check_request_spans(spans, "identity_fp32", span_id)


def test_grpc_metadata_traceparent(server, collector):
    import tritonclient.grpc as grpcclient

    header, trace_id, span_id = _traceparent()
    with grpcclient.InferenceServerClient(server.grpc) as client:
        inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        client.infer("identity_fp32", [inp], headers={"traceparent": header})
    spans = collector.trace(trace_id, 3)
    assert _children(spans) == {"InferRequest": ["identity_fp32"], "identity_fp32": ["compute"]}
    _check_request_spans(spans, "identity_fp32", span_id)


def test_sampled_request_without_context_is_a_root(server, collector):
    """No usable context (a malformed traceparent counts as none): a trace of its own, when sampled."""
    before = {s["traceId"] for s in collector.spans()}
    _identity_http(server, {"traceparent": "00-not-a-trace-context"})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        new = [s for s in collector.spans() if s["traceId"] not in before]
        if len(new) >= 3:
            break
        time.sleep(0.2)
    assert len({s["traceId"] for s in new}) == 1, new
    _check_request_spans(new, "identity_fp32", None)


def test_ensemble_steps_are_children_of_the_ensemble(server, collector):
    import tritonclient.http as httpclient

    header, trace_id, _ = _traceparent()
    with httpclient.InferenceServerClient(server.http) as client:
        inp = httpclient.InferInput("FEATURES", [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), dtype=np.float32))
        client.infer("ensemble_mlp", [inp], headers={"traceparent": header})
    spans = collector.trace(trace_id, 6)
    assert _children(spans) == {
        "InferRequest": ["ensemble_mlp"],
        "ensemble_mlp": ["mlp_onnx", "scale_python"],
        "mlp_onnx": ["compute"],
        "scale_python": ["compute"],
    }, spans
    by = _by_name(spans)
    ens = by["ensemble_mlp"][0]
    for step in ("mlp_onnx", "scale_python"):
        s = by[step][0]
        assert int(ens["startTimeUnixNano"]) <= int(s["startTimeUnixNano"])
        assert int(s["endTimeUnixNano"]) <= int(ens["endTimeUnixNano"])
    assert int(by["mlp_onnx"][0]["endTimeUnixNano"]) <= int(by["scale_python"][0]["startTimeUnixNano"])


@pytest.mark.parametrize("model", ["bls_traced", "bls_traced_process"])
def test_bls_call_with_trace_is_a_child(server, collector, model):
    import tritonclient.http as httpclient

    header, trace_id, _ = _traceparent()
    with httpclient.InferenceServerClient(server.http) as client:
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            inp = httpclient.InferInput(name, [4], "FP32")
            inp.set_data_from_numpy(np.arange(4, dtype=np.float32))
            inputs.append(inp)
        result = client.infer(model, inputs, headers={"traceparent": header})
    context = json.loads(result.as_numpy("CONTEXT")[0])
    assert context["traceparent"].split("-")[1] == trace_id  # request.trace().get_context(), as in Triton
    spans = collector.trace(trace_id, 5)
    assert _children(spans) == {
        "InferRequest": [model],
        model: ["add_sub", "compute"],
        "add_sub": ["compute"],
    }, spans
    by = _by_name(spans)
    assert context["traceparent"].split("-")[2] == by[model][0]["spanId"]


def test_decoupled_stream_with_metadata_traceparent(server, collector):
    """A decoupled model over a gRPC stream whose metadata carries the context: one INFER_RESPONSE_COMPLETE
    event on InferRequest per response, as Triton records them."""
    import queue

    import tritonclient.grpc as grpcclient

    header, trace_id, span_id = _traceparent()
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc) as client:
        client.start_stream(
            callback=lambda result, error: results.put(error or result), headers={"traceparent": header}
        )
        inputs = [grpcclient.InferInput("IN", [1], "INT32"), grpcclient.InferInput("COUNT", [1], "INT32")]
        inputs[0].set_data_from_numpy(np.array([7], dtype=np.int32))
        inputs[1].set_data_from_numpy(np.array([4], dtype=np.int32))
        client.async_stream_infer("repeat", inputs)
        got = [results.get(timeout=30) for _ in range(4)]
        client.stop_stream()
    assert all(not isinstance(r, Exception) for r in got), got
    spans = collector.trace(trace_id, 3)
    assert _children(spans) == {"InferRequest": ["repeat"], "repeat": ["compute"]}, spans
    by = _by_name(spans)
    root, span = by["InferRequest"][0], by["repeat"][0]
    assert root["parentSpanId"] == span_id
    responses = [t for n, t in _events(root) if n == "INFER_RESPONSE_COMPLETE"]
    assert len(responses) >= 4 and responses == sorted(responses)
    events = _events(span)
    assert [n for n, _ in events] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    assert events[0][1] <= responses[0] and responses[-1] <= events[-1][1]


def test_failed_request_spans_have_error_status(server, collector):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    header, trace_id, span_id = _traceparent()
    with httpclient.InferenceServerClient(server.http) as client:
        inp = httpclient.InferInput("INPUT0", [4], "FP32")
        inp.set_data_from_numpy(np.ones(4, dtype=np.float32))
        with pytest.raises(InferenceServerException, match="always fails"):
            client.infer("failing", [inp], headers={"traceparent": header})
    spans = collector.trace(trace_id, 3)
    assert _children(spans) == {"InferRequest": ["failing"], "failing": ["compute"]}, spans
    by = _by_name(spans)
    for name in ("InferRequest", "failing"):
        status = by[name][0]["status"]
        assert status["code"] in (2, "STATUS_CODE_ERROR") and "always fails" in status["message"], status
    assert by["InferRequest"][0]["parentSpanId"] == span_id


def test_trace_settings_change_sampling_live(server, collector):
    """A rate no request reaches keeps only requests with a client context; level OFF none; both through the
    settings APIs. In this mode the settings read as Triton's (recorded in docs/triton-behaviour.md)."""
    import tritonclient.grpc as grpcclient

    url = f"{server.url}/v2/trace/setting"
    settings = requests.get(url).json()
    assert settings == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "1",
        "trace_count": "-1",
        "trace_mode": "opentelemetry",
        "url": f"http://127.0.0.1:{collector.http_port}/v1/traces",
        "resource": "service.name=naiad-under-test,test.key=test.value",
        "bsp_max_export_batch_size": "512",
        "bsp_schedule_delay": "50",
        "bsp_max_queue_size": "2048",
    }
    # as Triton: rate 0 only at start, the mode and the exporter's settings ignored
    r = requests.post(url, json={"trace_rate": "0"})
    assert r.status_code == 400 and "sample rate must be non-zero" in r.json()["error"]
    r = requests.post(url, json={"trace_mode": "triton", "url": "http://elsewhere:4318"})
    assert r.status_code == 200 and r.json() == settings
    try:
        r = requests.post(url, json={"trace_rate": "1000000"})
        assert r.status_code == 200 and r.json()["trace_rate"] == "1000000", r.text
        before = {s["traceId"] for s in collector.spans()}
        _identity_http(server)
        header, trace_id, _ = _traceparent()
        _identity_http(server, {"traceparent": header})
        assert len(collector.trace(trace_id, 3)) == 3
        time.sleep(0.5)
        assert {s["traceId"] for s in collector.spans()} - before == {trace_id}

        with grpcclient.InferenceServerClient(server.grpc) as client:
            client.update_trace_settings(settings={"trace_level": ["OFF"]})
            got = client.get_trace_settings(as_json=True)["settings"]
            assert got["trace_level"]["value"] == ["OFF"] and got["trace_mode"]["value"] == ["opentelemetry"]
        header, trace_id, _ = _traceparent()
        _identity_http(server, {"traceparent": header})
        time.sleep(1.0)
        assert collector.trace(trace_id, 1, timeout=1.0) == []
    finally:
        requests.post(url, json={"trace_rate": "1", "trace_level": ["TIMESTAMPS"]})
    header, trace_id, _ = _traceparent()
    _identity_http(server, {"traceparent": header})
    assert len(collector.trace(trace_id, 3)) == 3


def test_otlp_grpc_export(model_repo, traced_repo, collector):
    import tritonclient.grpc as grpcclient

    proc = _serve(
        model_repo,
        traced_repo,
        collector,
        "--trace-config",
        "mode=opentelemetry",
        "--trace-config",
        "level=TIMESTAMPS",
        "--trace-config",
        "rate=0",
        "--trace-config",
        "opentelemetry,protocol=grpc",
        "--trace-config",
        f"opentelemetry,url=http://127.0.0.1:{collector.grpc_port}",
        "--trace-config",
        "opentelemetry,resource=service.name=naiad-under-test",
        "--trace-config",
        "opentelemetry,resource=test.key=test.value",
        "--trace-config",
        "opentelemetry,bsp_schedule_delay=50",
        "--grpc-implementation",
        "grpcio",
    )
    try:
        header, trace_id, span_id = _traceparent()
        before = {s["traceId"] for s in collector.spans()}
        _identity_http(proc)  # rate=0: not traced
        _identity_http(proc, {"traceparent": header})  # traced for its context alone
        spans = collector.trace(trace_id, 3)
        _check_request_spans(spans, "identity_fp32", span_id)
        time.sleep(0.5)
        assert {s["traceId"] for s in collector.spans()} - before == {trace_id}
        # and grpc.aio's metadata (this server runs --grpc-implementation grpcio)
        header, trace_id, span_id = _traceparent()
        with grpcclient.InferenceServerClient(proc.grpc) as client:
            inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
            inp.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
            client.infer("identity_fp32", [inp], headers={"traceparent": header})
        _check_request_spans(collector.trace(trace_id, 3), "identity_fp32", span_id)
    finally:
        proc.stop()


def test_bad_opentelemetry_settings_are_refused(model_repo):
    for bad in (
        "opentelemetry,protocol=thrift",
        "opentelemetry,bsp_max_queue_size=0",
        "opentelemetry,nope=1",
    ):
        proc = NaiadProcess(model_repo, "--trace-config", bad, "--model-control-mode", "explicit")
        with pytest.raises(RuntimeError, match="naiad exited"):
            proc.start()
        assert bad.split(",")[1].split("=")[0] in proc.output()
