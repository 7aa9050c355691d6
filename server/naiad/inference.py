"""The one internal request/response shape that every frontend decodes into and encodes from."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Triton's request flags (TRITONSERVER_REQUEST_FLAG_*).
SEQUENCE_START = 1
SEQUENCE_END = 2


@dataclass(slots=True)
class RequestedOutput:
    name: str
    binary: bool | None = None  # None: the frontend's default
    classification: int = 0
    parameters: dict = field(default_factory=dict)


@dataclass(slots=True)
class InferenceRequest:
    model_name: str
    inputs: dict[str, np.ndarray]
    datatypes: dict[str, str]  # wire datatype of each input ("FP32", "BYTES", "BF16", ...)
    model_version: int = -1  # -1: the policy's latest ready version
    id: str = ""
    outputs: list[RequestedOutput] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    timeout_us: int = 0
    correlation_id: int | str = 0
    flags: int = 0
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    # Set by the server for decoupled models: called with each response from any thread.
    response_callback: Callable[[InferenceResponse], None] | None = None
    cancelled: bool = False
    # (name, monotonic ns) pairs when the trace extension sampled this request (a trace.RequestTrace)
    trace: list | None = None
    # The caller's span, when tracing: a W3C traceparent header from a frontend, or the calling request's
    # trace for ensemble steps and BLS calls
    traceparent: Any = None
    # Some input is in device memory (a device_tensors.DeviceTensor, or a CUDA shared-memory span not read yet)
    device_inputs: bool = False
    # The caller takes outputs in device memory (ensemble steps; BLS calls from a model that keeps GPU tensors)
    device_consumer: bool = False
    load_wait_ns: int = 0  # set when the request waited for its model to load on demand

    def batch_size(self, batched: bool) -> int:
        if not batched or not self.inputs:
            return 1
        first = next(iter(self.inputs.values()))
        return int(first.shape[0]) if first.ndim else 1


@dataclass(slots=True)
class OutputTensor:
    name: str
    datatype: str
    data: np.ndarray

    @property
    def shape(self) -> list[int]:
        return list(self.data.shape)


@dataclass(slots=True)
class InferenceResponse:
    model_name: str
    model_version: str
    outputs: list[OutputTensor] = field(default_factory=list)
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    error: Exception | None = None
    final: bool = True
    device_outputs: bool = False  # some output is a device_tensors.DeviceTensor
    # set by Server.infer_stream: the stream's next response is already waiting, so a writer may hold this one's
    # bytes and send both in one write (an engine step that outran the event loop: one send per burst, not token)
    more_ready: bool = False

    def output(self, name: str) -> OutputTensor | None:
        for o in self.outputs:
            if o.name == name:
                return o
        return None
