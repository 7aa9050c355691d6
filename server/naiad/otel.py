"""OpenTelemetry trace mode: traced requests exported as Triton's spans over OTLP with the OpenTelemetry SDK.

Spans, as Triton names them: `InferRequest` (the request as a frontend received it; a child of the client's span
when the request carried a W3C `traceparent`), its child `<model name>` with the REQUEST_START, QUEUE_START and
REQUEST_END events and `model_name`/`model_version`/`request_id` attributes, and that span's child `compute` with
the COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START and COMPUTE_END events; a decoupled model's
responses are INFER_RESPONSE_COMPLETE events on `InferRequest`. Ensemble steps and BLS calls
made with `trace=request.trace()` are model spans under the calling model's span. Spans go through a
BatchSpanProcessor: a bounded queue that a request never waits on (a full queue drops spans, as the SDK does).
Needs the `otel` extra (opentelemetry-sdk and the OTLP exporters); imported only when the mode is chosen.
"""

from __future__ import annotations

import logging
import time

from .errors import InvalidArgument

log = logging.getLogger("naiad.trace")

# `--trace-config opentelemetry,<setting>=<value>`: Triton's names and defaults, plus `protocol` (Naiad's: Triton
# only exports over OTLP/HTTP).
DEFAULTS = {
    "url": "http://localhost:4318/v1/traces",
    "resource": {"service.name": "naiad"},
    "bsp_max_queue_size": 2048,
    "bsp_schedule_delay": 5000,
    "bsp_max_export_batch_size": 512,
    "protocol": "http/protobuf",
}
PROTOCOLS = ("http/protobuf", "grpc")
COMPUTE_EVENTS = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")


def parse_setting(settings: dict, key: str, value: str) -> None:
    """Apply one `opentelemetry,<key>=<value>` to `settings`; ValueError names what was expected."""
    if key == "resource":
        name, sep, val = value.partition("=")
        if not sep or not name:
            raise ValueError(f"invalid opentelemetry resource '{value}', expected <key>=<value>")
        settings["resource"] = {**settings.get("resource", DEFAULTS["resource"]), name: val}
    elif key in ("bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size"):
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"opentelemetry setting '{key}' must be an integer, got '{value}'") from None
        if n <= 0:
            raise ValueError(f"opentelemetry setting '{key}' must be positive, got {n}")
        settings[key] = n
    elif key == "protocol":
        if value not in PROTOCOLS:
            raise ValueError(f"opentelemetry protocol must be one of {', '.join(PROTOCOLS)}, got '{value}'")
        settings[key] = value
    elif key == "url":
        if not value:
            raise ValueError("opentelemetry url must not be empty")
        settings[key] = value
    else:
        raise ValueError(
            f"unknown opentelemetry trace setting '{key}' (known: url, resource, protocol, "
            "bsp_max_queue_size, bsp_schedule_delay, bsp_max_export_batch_size)"
        )


class OtelExporter:
    """One TracerProvider with a BatchSpanProcessor in front of an OTLP exporter (HTTP or gRPC)."""

    def __init__(self, settings: dict):
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise InvalidArgument(
                f"trace mode 'opentelemetry' needs the OpenTelemetry SDK: pip install 'naiad[otel]' ({exc})"
            ) from None
        s = {**DEFAULTS, **settings}
        if s["bsp_max_export_batch_size"] > s["bsp_max_queue_size"]:
            raise InvalidArgument("bsp_max_export_batch_size must not exceed bsp_max_queue_size")
        if s["protocol"] == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            url = s["url"]
            exporter = OTLPSpanExporter(endpoint=url, insecure=not url.startswith("https://"))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=s["url"])
        # ALWAYS_ON: Naiad's own rate/count decide what is traced, and a client's context is followed even when
        # its sampled flag is off, as Triton does.
        self.provider = TracerProvider(resource=Resource.create(s["resource"]), sampler=ALWAYS_ON)
        self.processor = BatchSpanProcessor(
            exporter,
            max_queue_size=s["bsp_max_queue_size"],
            schedule_delay_millis=s["bsp_schedule_delay"],
            max_export_batch_size=s["bsp_max_export_batch_size"],
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("naiad")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self.settings = s

    def remote_parent(self, header: str):
        """The context of a W3C traceparent value, or None when it does not parse."""
        ctx = self._propagator.extract({"traceparent": header})
        return ctx if self._trace.get_current_span(ctx).get_span_context().is_valid else None

    def begin(self, record, model: str, version: str, request, parent_ctx, nested: bool) -> None:
        """Open the request's spans (children need the model span's context while it runs)."""
        trace = self._trace
        offset = time.time_ns() - time.monotonic_ns()  # spans carry wall-clock time; Naiad records monotonic
        record.offset = offset
        start = request.arrival_ns + offset
        if not nested:
            record.root = self.tracer.start_span(
                "InferRequest", context=parent_ctx, kind=trace.SpanKind.SERVER, start_time=start
            )
            parent_ctx = trace.set_span_in_context(record.root)
        attributes = {"model_name": model, "model_version": version}
        if request.id:
            attributes["request_id"] = request.id
        record.span = self.tracer.start_span(
            model, context=parent_ctx, start_time=start, attributes=attributes
        )

    def context_of(self, record):
        return self._trace.set_span_in_context(record.span)

    def end(self, record, error: BaseException | None) -> None:
        """Close the request's spans from its recorded timestamps."""
        offset = record.offset
        span = record.span
        compute = [(n, ns) for n, ns in record if n in COMPUTE_EVENTS]
        for name, ns in record:
            if name in COMPUTE_EVENTS:
                continue
            # Triton records each streamed response on the request's top span
            target = record.root if name == "INFER_RESPONSE_COMPLETE" and record.root is not None else span
            target.add_event(name, timestamp=ns + offset)
        if compute:
            times = dict(compute)
            first, last = min(ns for _, ns in compute), max(ns for _, ns in compute)
            child = self.tracer.start_span(
                "compute",
                context=self.context_of(record),
                start_time=times.get("COMPUTE_START", first) + offset,
            )
            for name, ns in compute:
                child.add_event(name, timestamp=ns + offset)
            child.end(end_time=times.get("COMPUTE_END", last) + offset)
        end = record[-1][1] + offset if record else time.time_ns()
        if error is not None:
            status = self._trace.Status(self._trace.StatusCode.ERROR, str(error))
            span.set_status(status)
            if record.root is not None:
                record.root.set_status(status)
        span.end(end_time=end)
        if record.root is not None:
            record.root.end(end_time=end)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout), then stop the export thread."""
        try:
            self.processor.force_flush(timeout_millis=5000)
            self.provider.shutdown()
        except Exception as exc:  # a collector going away must not fail the server's shutdown
            log.warning("OpenTelemetry trace export did not shut down cleanly: %s", exc)
