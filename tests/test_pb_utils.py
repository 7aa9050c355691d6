"""`triton_python_backend_utils` as python_backend's full public API, checked name by name through served models.

Every model is served twice, in-process (`_thread`) and in a worker process (`_process`), because the two
reach the server differently (direct calls versus the worker's side channel). The list of names is
python_backend's `triton_python_backend_utils` module plus the `c_python_backend_utils` names it re-exports.
"""

from __future__ import annotations

import queue
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import NaiadProcess

MODES = ("thread", "process")
ISOLATION = 'parameters {{ key: "EXECUTION_ISOLATION" value: {{ string_value: "{}" }} }}\n'

# ---- a model that runs one named check of the API per request ----

API = r'''
import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def expect_error(fn, text, kind=pb_utils.TritonModelException):
    try:
        fn()
    except kind as exc:
        message = exc.message() if hasattr(exc, "message") and callable(exc.message) else str(exc)
        assert text in message, f"{text!r} not in {message!r}"
        return
    raise AssertionError(f"no {kind.__name__} raised")


class TritonPythonModel:
    """NAME selects a check of the pb_utils API; RESULT is "ok" or what failed."""

    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.args = args

    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "NAME").as_numpy()[0].decode()
            try:
                getattr(self, "check_" + name.replace(".", "_"))(request)
                result = "ok"
            except Exception as exc:
                result = f"FAIL {name}: {type(exc).__name__}: {exc}"
            out = pb_utils.Tensor("RESULT", np.array([result.encode()], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses

    # -- triton_python_backend_utils.py --
    def check_TRITON_STRING_TO_NUMPY(self, request):
        table = pb_utils.TRITON_STRING_TO_NUMPY
        assert table["TYPE_FP32"] is np.float32 and table["TYPE_STRING"] is np.object_
        assert table["TYPE_BOOL"] is bool and table["TYPE_UINT64"] is np.uint64
        assert "TYPE_BF16" not in table

    def check_serialize_byte_tensor(self, request):
        data = pb_utils.serialize_byte_tensor(np.array([b"ab", "c"], dtype=np.object_))
        assert data == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c", data
        assert pb_utils.serialize_byte_tensor(np.array([], dtype=np.object_)) == ()
        assert pb_utils.serialize_byte_tensor(np.array([1.0], dtype=np.float32)) is None

    def check_deserialize_bytes_tensor(self, request):
        strings = np.array([b"x", b"", "\u00e9".encode()], dtype=np.object_)
        back = pb_utils.deserialize_bytes_tensor(pb_utils.serialize_byte_tensor(strings))
        assert back.dtype == np.object_ and list(back) == list(strings), back

    def check_get_input_tensor_by_name(self, request):
        assert pb_utils.get_input_tensor_by_name(request, "NAME").name() == "NAME"
        assert pb_utils.get_input_tensor_by_name(request, "MISSING") is None

    def check_get_output_tensor_by_name(self, request):
        response = pb_utils.InferenceResponse([pb_utils.Tensor("A", np.zeros(2, np.int8))])
        assert pb_utils.get_output_tensor_by_name(response, "A").shape() == [2]
        assert pb_utils.get_output_tensor_by_name(response, "B") is None

    def check_get_input_config_by_name(self, request):
        assert pb_utils.get_input_config_by_name(self.model_config, "NAME")["data_type"] == "TYPE_STRING"
        assert pb_utils.get_input_config_by_name(self.model_config, "NOPE") is None

    def check_get_output_config_by_name(self, request):
        assert pb_utils.get_output_config_by_name(self.model_config, "RESULT")["dims"] == [1]
        assert pb_utils.get_output_config_by_name(self.model_config, "NOPE") is None

    def check_using_decoupled_model_transaction_policy(self, request):
        assert pb_utils.using_decoupled_model_transaction_policy(self.model_config) is False
        assert pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": True}})
        assert not pb_utils.using_decoupled_model_transaction_policy({})

    def check_triton_to_numpy_type(self, request):
        assert pb_utils.triton_to_numpy_type(11) == np.float32
        assert pb_utils.triton_to_numpy_type(13) == np.object_
        assert pb_utils.triton_to_numpy_type(1) == np.bool_

    def check_numpy_to_triton_type(self, request):
        assert pb_utils.numpy_to_triton_type(np.float32) == 11
        assert pb_utils.numpy_to_triton_type(np.object_) == 13
        assert pb_utils.numpy_to_triton_type(np.bytes_) == 13
        assert pb_utils.numpy_to_triton_type(np.int64) == 9

    def check_triton_string_to_numpy(self, request):
        assert pb_utils.triton_string_to_numpy("TYPE_INT32") == np.int32
        assert pb_utils.triton_string_to_numpy("TYPE_STRING") == np.object_

    def check_ModelConfig(self, request):
        config = pb_utils.ModelConfig(json.dumps({"name": "m", "max_batch_size": 0, "input": [], "output": []}))
        config.set_max_batch_size(4)
        config.add_input({"name": "I", "data_type": "TYPE_FP32", "dims": [2]})
        config.add_output({"name": "O", "data_type": "TYPE_FP32", "dims": [2]})
        config.set_dynamic_batching()
        config.set_model_transaction_policy({"decoupled": False})
        d = config.as_dict()
        assert d["max_batch_size"] == 4 and d["input"][0]["name"] == "I" and "dynamic_batching" in d
        expect_error(lambda: config.add_input({"name": "I", "data_type": "TYPE_INT8", "dims": [2]}),
                     "configuration expects datatype TYPE_FP32", ValueError)
        expect_error(lambda: config.add_input({"name": "J", "data_type": "TYPE_FP32", "dims": [1], "x": 1}),
                     "contains property other than", ValueError)
        expect_error(lambda: config.set_model_transaction_policy({"decoupled": True}),
                     "trying to change decoupled property", ValueError)

    def check_TRITONSERVER_flags(self, request):
        assert pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START == 1
        assert pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END == 2
        assert pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL == 1
        assert pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL == 1
        assert pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE == 2

    # -- c_python_backend_utils --
    def check_TritonError(self, request):
        codes = [pb_utils.TritonError.UNKNOWN, pb_utils.TritonError.INTERNAL, pb_utils.TritonError.NOT_FOUND,
                 pb_utils.TritonError.INVALID_ARG, pb_utils.TritonError.UNAVAILABLE,
                 pb_utils.TritonError.UNSUPPORTED, pb_utils.TritonError.ALREADY_EXISTS,
                 pb_utils.TritonError.CANCELLED]
        assert codes == list(range(8)), codes
        error = pb_utils.TritonError("gone")
        assert error.message() == "gone" and error.code() == pb_utils.TritonError.INTERNAL
        assert pb_utils.TritonError("x", pb_utils.TritonError.NOT_FOUND).code() == 2

    def check_TritonModelException(self, request):
        expect_error(lambda: (_ for _ in ()).throw(pb_utils.TritonModelException("said no")), "said no")
        assert issubclass(pb_utils.TritonModelException, Exception)

    def check_PreferredMemory(self, request):
        memory = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)
        assert memory.preferred_memory_type == pb_utils.TRITONSERVER_MEMORY_CPU
        assert pb_utils.MemoryType.TRITONSERVER_MEMORY_GPU == pb_utils.TRITONSERVER_MEMORY_GPU == 0
        assert pb_utils.MemoryType.TRITONSERVER_MEMORY_CPU == pb_utils.TRITONSERVER_MEMORY_CPU == 1

    def check_InferenceTrace(self, request):
        assert isinstance(request.trace(), pb_utils.InferenceTrace)
        assert request.trace().get_context() is None

    def check_InferenceRequest_fields(self, request):
        assert request.request_id() == "req-7", request.request_id()
        assert request.correlation_id() == 0
        assert request.flags() == 0 and request.timeout() == 0
        assert json.loads(request.parameters())["colour"] == "blue", request.parameters()
        assert request.requested_output_names() == ["RESULT"]
        assert [t.name() for t in request.inputs()] == ["NAME"]
        assert request.is_cancelled() is False

    def check_InferenceRequest_set_flags(self, request):
        bls = pb_utils.InferenceRequest(model_name="identity", inputs=[], requested_output_names=["OUTPUT0"])
        bls.set_flags(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
        assert bls.flags() == 1
        expect_error(lambda: pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[],
                                                       correlation_id=1.5), "Correlation ID must be integer")
        assert pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[],
                                         correlation_id="seq-a").correlation_id() == "seq-a"

    def check_InferenceRequest_set_release_flags(self, request):
        request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
        expect_error(lambda: request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE),
                     "iterative_sequence")

    def _bls(self):
        data = pb_utils.Tensor("INPUT0", np.array([[1.5, 2.5]], np.float32))
        return pb_utils.InferenceRequest(model_name="identity", inputs=[data], requested_output_names=["OUTPUT0"],
                                         preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU))

    def check_InferenceRequest_exec(self, request):
        response = self._bls().exec()
        assert not response.has_error(), response.error()
        out = pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()
        assert out.tolist() == [[1.5, 2.5]], out

    def check_InferenceRequest_async_exec(self, request):
        async def run():
            return await self._bls().async_exec()

        response = asyncio.run(run())
        assert not response.has_error(), response.error()
        assert pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy().tolist() == [[1.5, 2.5]]

    def check_Tensor(self, request):
        t = pb_utils.Tensor("X", np.arange(6, dtype=np.float32).reshape(2, 3))
        assert t.name() == "X" and t.shape() == [2, 3] and t.triton_dtype() == 11 and t.is_cpu()
        assert t.as_numpy().sum() == 15
        assert pb_utils.Tensor("S", np.array(["a"], dtype=np.object_)).triton_dtype() == 13

    def check_Tensor_to_dlpack(self, request):
        t = pb_utils.Tensor("X", np.arange(4, dtype=np.int32))
        back = pb_utils.Tensor.from_dlpack("Y", t.to_dlpack())
        assert back.name() == "Y" and back.as_numpy().tolist() == [0, 1, 2, 3]

    def check_Tensor_from_dlpack(self, request):
        t = pb_utils.Tensor("X", np.arange(3, dtype=np.float64))
        assert pb_utils.Tensor.from_dlpack("Z", t).as_numpy().tolist() == [0.0, 1.0, 2.0]
        assert pb_utils.Tensor.from_dlpack("W", np.ones(2, np.int8)).as_numpy().tolist() == [1, 1]

    def check_Tensor_dlpack_protocol(self, request):
        t = pb_utils.Tensor("X", np.arange(3, dtype=np.int64))
        assert t.__dlpack_device__() == (1, 0)
        assert np.from_dlpack(t).tolist() == [0, 1, 2]

    def check_InferenceResponse(self, request):
        r = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("A", np.ones(1, np.int8))],
                                       parameters={"k": "v", "n": 2})
        assert not r.has_error() and r.error() is None and len(r.output_tensors()) == 1
        assert json.loads(r.parameters()) == {"k": "v", "n": 2}
        e = pb_utils.InferenceResponse(error=pb_utils.TritonError("bad", pb_utils.TritonError.INVALID_ARG))
        assert e.has_error() and e.error().message() == "bad" and e.error().code() == 3

    def check_InferenceResponseSender(self, request):
        assert pb_utils.InferenceResponseSender is type(request.get_response_sender())
        assert request.get_response_sender().is_cancelled() is False

    def check_Logger(self, request):
        logger = pb_utils.Logger
        assert logger.LogLevel.INFO == 0 and logger.LogLevel.VERBOSE == 3
        logger.log(f"pb-api logger {self.args['model_name']}", logger.LogLevel.WARNING)
        logger.log_info("pb-api info")
        logger.log_warn(f"pb-api warn {self.args['model_name']}")
        logger.log_error(f"pb-api error {self.args['model_name']}")
        logger.log_verbose("pb-api verbose")

    def check_MetricFamily(self, request):
        assert pb_utils.MetricFamily.COUNTER == pb_utils.MetricKind.COUNTER == pb_utils.COUNTER == 0
        assert pb_utils.MetricFamily.GAUGE == 1 and pb_utils.MetricFamily.HISTOGRAM == 2
        expect_error(lambda: pb_utils.MetricFamily("bad name", "d", pb_utils.MetricFamily.COUNTER),
                     "Invalid metric name")
        expect_error(lambda: pb_utils.MetricFamily("api_kind", "d", 7), "unknown metric kind")
        pb_utils.MetricFamily("api_kind_" + self.args["model_name"], "d", pb_utils.MetricFamily.GAUGE)
        expect_error(lambda: pb_utils.MetricFamily("api_kind_" + self.args["model_name"], "d",
                                                   pb_utils.MetricFamily.COUNTER), "Family name already exists with different type")

    def check_Metric(self, request):
        name = self.args["model_name"]
        counter = pb_utils.MetricFamily("api_c_" + name, "c", pb_utils.MetricFamily.COUNTER).Metric({"k": "v"})
        gauge = pb_utils.MetricFamily("api_g_" + name, "g", pb_utils.MetricFamily.GAUGE).Metric()
        hist = pb_utils.MetricFamily("api_h_" + name, "h", pb_utils.MetricFamily.HISTOGRAM)
        expect_error(lambda: counter.increment(-1), "COUNTER can only be incremented monotonically by non-negative values")
        expect_error(lambda: counter.set(3), "TRITONSERVER_METRIC_KIND_COUNTER does not support Set")
        expect_error(lambda: gauge.observe(3), "TRITONSERVER_METRIC_KIND_GAUGE does not support Observe")
        expect_error(lambda: hist.Metric(), "Missing required buckets")
        expect_error(lambda: hist.Metric(labels=["x"]), "Labels must be a dictionary")
        expect_error(lambda: hist.Metric(buckets=[1.0]).value(), "TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Value")
        counter.increment(2)
        gauge.set(-4.5)
        gauge.increment(1)
        assert counter.value() == 2 and gauge.value() == -3.5, (counter.value(), gauge.value())

    def check_model_control(self, request):
        assert pb_utils.is_model_ready("identity")
        assert not pb_utils.is_model_ready("no_such_model")
        assert pb_utils.is_model_ready("identity", "1") and not pb_utils.is_model_ready("identity", "9")
        expect_error(lambda: pb_utils.load_model("no_such_model"), "no_such_model")
'''

API_CONFIG = """
backend: "python"
input [ { name: "NAME" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "RESULT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

API_CHECKS = [
    "TRITON_STRING_TO_NUMPY",
    "serialize_byte_tensor",
    "deserialize_bytes_tensor",
    "get_input_tensor_by_name",
    "get_output_tensor_by_name",
    "get_input_config_by_name",
    "get_output_config_by_name",
    "using_decoupled_model_transaction_policy",
    "triton_to_numpy_type",
    "numpy_to_triton_type",
    "triton_string_to_numpy",
    "ModelConfig",
    "TRITONSERVER_flags",
    "TritonError",
    "TritonModelException",
    "PreferredMemory",
    "InferenceTrace",
    "InferenceRequest.fields",
    "InferenceRequest.set_flags",
    "InferenceRequest.set_release_flags",
    "InferenceRequest.exec",
    "InferenceRequest.async_exec",
    "Tensor",
    "Tensor.to_dlpack",
    "Tensor.from_dlpack",
    "Tensor.dlpack_protocol",
    "InferenceResponse",
    "InferenceResponseSender",
    "Logger",
    "MetricFamily",
    "Metric",
    "model_control",
]

IDENTITY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy())])
                for r in requests]
"""
IDENTITY_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

# ---- decoupled: a model of our own with the API calls of Triton's repeat_int32 example ----

REPEAT = r'''
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """For IN of n values: n responses (OUT = IN[i] repeated output_num_elements times, IDX = i), the i-th
    after DELAY[i] ms, sent by a thread; execute returns after WAIT ms."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(f"model '{args['model_name']}' needs a decoupled transaction policy")
        self.out_type = pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, "OUT")["data_type"])
        self.idx_type = pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, "IDX")["data_type"])
        param = config.get("parameters", {}).get("output_num_elements", {}).get("string_value", "1")
        self.repeat = int(param)
        self.running = 0
        self.lock = threading.Lock()

    def execute(self, requests):
        if len(requests) != 1:
            raise pb_utils.TritonModelException(f"expected one request, got {len(requests)}")
        request = requests[0]
        values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
        if values.shape != delays.shape:
            raise pb_utils.TritonModelException(
                f"IN and DELAY must have the same shape, got {list(values.shape)} and {list(delays.shape)}")
        with self.lock:
            self.running += 1
        sender = request.get_response_sender()
        threading.Thread(target=self._respond, args=(sender, values, delays), daemon=True).start()
        time.sleep(int(pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()[0]) / 1000.0)
        return None

    def _respond(self, sender, values, delays):
        for i, (value, delay) in enumerate(zip(values, delays)):
            time.sleep(int(delay) / 1000.0)
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("IDX", np.array([i], self.idx_type)),
                pb_utils.Tensor("OUT", np.full((self.repeat,), value, self.out_type)),
            ]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with self.lock:
            self.running -= 1

    def finalize(self):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with self.lock:
                if self.running == 0:
                    break
            time.sleep(0.05)
'''
REPEAT_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: {decoupled} }
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
"""

# ---- decoupled BLS with ResponseIterator.cancel() ----

COUNTDOWN = r'''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled: up to N responses 10 ms apart, stopping early when the request is cancelled."""

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            for i in range(n):
                if sender.is_cancelled():
                    break
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
                time.sleep(0.01)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
COUNTDOWN_CONFIG = """
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

CANCELLER = r'''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Asks countdown for 500 responses over BLS, cancels after the third; returns how many arrived."""

    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(model_name="countdown", requested_output_names=["OUT"],
                                             inputs=[pb_utils.Tensor("N", np.array([500], np.int32))])
            iterator = call.exec(decoupled=True)
            assert isinstance(iterator, pb_utils.ResponseIterator)
            count = 0
            for response in iterator:
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                if pb_utils.get_output_tensor_by_name(response, "OUT") is not None:
                    count += 1
                if count == 3:
                    iterator.cancel()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("COUNT", np.array([count], np.int32))]))
        return responses
'''
CANCELLER_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# ---- custom metrics: one counter, gauge and histogram family shared by every instance of a model ----

METRICS = r"""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.requests = pb_utils.MetricFamily(
            name="custom_model_requests", description="Requests seen by the model",
            kind=pb_utils.MetricFamily.COUNTER).Metric(labels=labels)
        self.last = pb_utils.MetricFamily(
            name="custom_model_last_value", description="Last X seen", kind=pb_utils.MetricFamily.GAUGE
        ).Metric(labels=labels)
        self.values = pb_utils.MetricFamily(
            name="custom_model_values", description="X values", kind=pb_utils.MetricFamily.HISTOGRAM
        ).Metric(labels=labels, buckets=[1.0, 10.0, 100.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = float(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
            self.requests.increment(1)
            self.last.set(x)
            self.values.observe(x)
            count = pb_utils.Tensor("COUNT", np.array([self.requests.value()], np.float64))
            responses.append(pb_utils.InferenceResponse([count]))
        return responses
"""
METRICS_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "COUNT" data_type: TYPE_FP64 dims: [ 1 ] } ]
"""

# ---- model control from a model ----

CONTROLLER = r'''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """ACTION load|unload|load_config|ready on model TARGET; READY: is_model_ready(TARGET) afterwards."""

    def execute(self, requests):
        responses = []
        for request in requests:
            action = pb_utils.get_input_tensor_by_name(request, "ACTION").as_numpy()[0].decode()
            target = pb_utils.get_input_tensor_by_name(request, "TARGET").as_numpy()[0].decode()
            try:
                if action == "load":
                    pb_utils.load_model(model_name=target)
                elif action == "load_config":
                    config = {"backend": "python", "max_batch_size": 2,
                              "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
                              "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]}
                    pb_utils.load_model(target, config=json.dumps(config))
                elif action == "unload":
                    pb_utils.unload_model(target, unload_dependents=False)
                ready = pb_utils.is_model_ready(model_name=target)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("READY", np.array([ready]))]))
            except pb_utils.TritonModelException as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(exc.message())))
        return responses
'''
CONTROLLER_CONFIG = """
backend: "python"
input [ { name: "ACTION" data_type: TYPE_STRING dims: [ 1 ] }, { name: "TARGET" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "READY" data_type: TYPE_BOOL dims: [ 1 ] } ]
"""


def write_model(repo: Path, name: str, code: str, config: str, isolation: str | None = None, count: int = 1):
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    text = f'name: "{name}"\n' + config + f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n"
    if isolation:
        text += ISOLATION.format(isolation)
    (repo / name / "config.pbtxt").write_text(text)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("pb_utils") / "models"
    repo.mkdir()
    for mode in MODES:
        write_model(repo, f"api_{mode}", API, API_CONFIG, mode)
        write_model(repo, f"repeat_int32_{mode}", REPEAT, REPEAT_CONFIG.replace("{decoupled}", "true"), mode)
        write_model(repo, f"canceller_{mode}", CANCELLER, CANCELLER_CONFIG, mode)
        write_model(repo, f"controller_{mode}", CONTROLLER, CONTROLLER_CONFIG, mode)
        # two worker processes in process mode: both count into the same metrics
        write_model(
            repo, f"metrics_{mode}", METRICS, METRICS_CONFIG, mode, count=2 if mode == "process" else 1
        )
    write_model(repo, "repeat_coupled", REPEAT, REPEAT_CONFIG.replace("{decoupled}", "false"))
    write_model(repo, "identity", IDENTITY, IDENTITY_CONFIG)
    write_model(repo, "spare", IDENTITY, IDENTITY_CONFIG)
    write_model(repo, "countdown", COUNTDOWN, COUNTDOWN_CONFIG)
    return repo


@pytest.fixture(scope="module")
def server(repo):
    names = [p.name for p in repo.iterdir() if p.name != "repeat_coupled"]
    args = ["--model-control-mode", "explicit", "--strict-readiness", "false"]
    for name in names:
        args += ["--load-model", name]
    with NaiadProcess(repo, *args, timeout=180) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.http, network_timeout=60)
    yield c
    c.close()


def _bytes(name: str, value: str) -> httpclient.InferInput:
    inp = httpclient.InferInput(name, [1], "BYTES")
    inp.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
    return inp


def _scalar(name: str, value, datatype: str, module=httpclient):
    inp = module.InferInput(name, [1], datatype)
    inp.set_data_from_numpy(np.array([value], dtype={"INT32": np.int32, "FP32": np.float32}[datatype]))
    return inp


# ---- one test per public name ----


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("check", API_CHECKS)
def test_pb_utils_name(client, mode, check):
    result = client.infer(
        f"api_{mode}",
        [_bytes("NAME", check)],
        request_id="req-7",
        parameters={"colour": "blue"},
        outputs=[httpclient.InferRequestedOutput("RESULT")],
    )
    assert result.as_numpy("RESULT")[0].decode() == "ok"


def test_every_public_name_of_python_backend_is_there():
    """The names python_backend's module and its C++ module define, all importable from Naiad's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
    from naiad.backends.python import triton_python_backend_utils as pb_utils

    names = """TRITON_STRING_TO_NUMPY serialize_byte_tensor deserialize_bytes_tensor get_input_tensor_by_name
    get_output_tensor_by_name get_input_config_by_name get_output_config_by_name
    using_decoupled_model_transaction_policy triton_to_numpy_type numpy_to_triton_type triton_string_to_numpy
    ModelConfig TRITONSERVER_REQUEST_FLAG_SEQUENCE_START TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
    TRITONSERVER_RESPONSE_COMPLETE_FINAL TRITONSERVER_REQUEST_RELEASE_ALL TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
    TritonError PreferredMemory MemoryType TRITONSERVER_MEMORY_GPU TRITONSERVER_MEMORY_CPU InferenceTrace
    InferenceRequest Tensor InferenceResponse InferenceResponseSender ResponseIterator Logger Metric MetricKind
    COUNTER GAUGE HISTOGRAM MetricFamily load_model unload_model is_model_ready TritonModelException""".split()
    assert [n for n in names if not hasattr(pb_utils, n)] == []
    methods = {
        "InferenceRequest": "inputs request_id correlation_id flags set_flags timeout parameters trace exec "
        "async_exec requested_output_names get_response_sender is_cancelled set_release_flags",
        "Tensor": "name as_numpy triton_dtype to_dlpack is_cpu shape from_dlpack __dlpack__ __dlpack_device__",
        "InferenceResponse": "output_tensors has_error error parameters",
        "InferenceResponseSender": "send is_cancelled",
        "ResponseIterator": "__iter__ __next__ cancel",
        "Logger": "log log_info log_warn log_error log_verbose LogLevel",
        "Metric": "increment set observe value",
        "MetricFamily": "Metric COUNTER GAUGE HISTOGRAM",
        "TritonError": "code message UNKNOWN INTERNAL NOT_FOUND INVALID_ARG UNAVAILABLE UNSUPPORTED "
        "ALREADY_EXISTS CANCELLED",
        "InferenceTrace": "get_context",
        "ModelConfig": "as_dict set_max_batch_size set_dynamic_batching add_input add_output "
        "set_model_transaction_policy",
    }
    missing = [
        f"{c}.{m}" for c, ms in methods.items() for m in ms.split() if not hasattr(getattr(pb_utils, c), m)
    ]
    assert missing == []


def test_logger_records_reach_the_server_log(client, server):
    for mode in MODES:
        client.infer(f"api_{mode}", [_bytes("NAME", "Logger")])
        for text in (f"pb-api logger api_{mode}", f"pb-api warn api_{mode}", f"pb-api error api_{mode}"):
            deadline = time.monotonic() + 10
            while text not in server.output() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert text in server.output()


# ---- decoupled: the repeat model over a gRPC stream ----


def _repeat_inputs(values: list[int], delays: list[int], wait: int) -> list:
    inputs = [
        grpcclient.InferInput("IN", [len(values)], "INT32"),
        grpcclient.InferInput("DELAY", [len(delays)], "UINT32"),
        grpcclient.InferInput("WAIT", [1], "UINT32"),
    ]
    inputs[0].set_data_from_numpy(np.array(values, np.int32))
    inputs[1].set_data_from_numpy(np.array(delays, np.uint32))
    inputs[2].set_data_from_numpy(np.array([wait], np.uint32))
    return inputs


@pytest.mark.parametrize("mode", MODES)
def test_repeat_int32_over_a_grpc_stream(server, mode):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: results.put(error if error is not None else result))
    try:
        # two requests whose responses interleave: execute returns (WAIT) before the responses are all sent
        client.async_stream_infer(
            f"repeat_int32_{mode}", _repeat_inputs([4, 2, 0, 1], [1, 30, 1, 30], 5), request_id="a"
        )
        client.async_stream_infer(f"repeat_int32_{mode}", _repeat_inputs([7, 8], [10, 10], 5), request_id="b")
        client.async_stream_infer(f"repeat_int32_{mode}", _repeat_inputs([], [], 0), request_id="empty")
        got: dict[str, list] = {"a": [], "b": []}
        for _ in range(6):
            item = results.get(timeout=30)
            assert not isinstance(item, Exception), item.message()
            rid = item.get_response().id
            got[rid].append((int(item.as_numpy("IDX")[0]), int(item.as_numpy("OUT")[0])))
    finally:
        client.stop_stream()
        client.close()
    assert got == {"a": [(0, 4), (1, 2), (2, 0), (3, 1)], "b": [(0, 7), (1, 8)]}
    assert results.empty()  # the empty request got no response (its final flag carries none)


def test_repeat_int32_refuses_a_coupled_config(client):
    with pytest.raises(InferenceServerException) as info:
        client.load_model("repeat_coupled")
    assert "needs a decoupled transaction policy" in info.value.message()
    assert not client.is_model_ready("repeat_coupled")


def test_repeat_int32_checks_its_inputs(server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: results.put(error if error is not None else result))
    try:
        client.async_stream_infer("repeat_int32_process", _repeat_inputs([1, 2], [1], 0))
        item = results.get(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    assert isinstance(item, InferenceServerException)
    assert "IN and DELAY must have the same shape, got [2] and [1]" in item.message()


# ---- decoupled BLS: ResponseIterator.cancel ----


@pytest.mark.parametrize("mode", MODES)
def test_response_iterator_cancel_stops_the_callee(client, mode):
    count = int(client.infer(f"canceller_{mode}", [_scalar("X", 0, "INT32")]).as_numpy("COUNT")[0])
    # cancelled after 3; at most a response or two were on their way, never the 500 asked for
    assert 3 <= count < 10, count


# ---- custom metrics on /metrics ----


def _metric_lines(server, family: str) -> dict[str, float]:
    text = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(rf"^({family}(?:_bucket|_sum|_count)?{{[^}}]*}}|{family}) (\S+)$", text, re.M)
    }


@pytest.mark.parametrize("mode", MODES)
def test_custom_metrics_show_on_the_metrics_endpoint(server, mode):
    model = f"metrics_{mode}"
    c = httpclient.InferenceServerClient(server.http, concurrency=4)
    try:
        # concurrent requests reach both instances (worker processes) in process mode
        pending = [c.async_infer(model, [_scalar("X", x, "FP32")]) for x in (0.5, 5.0, 50.0, 500.0) * 5]
        counts = [float(p.get_result().as_numpy("COUNT")[0]) for p in pending]
    finally:
        c.close()
    assert max(counts) == 20  # one counter for every instance: the last increment saw all 20
    labels = f'model="{model}",version="1"'
    text = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
    assert "# TYPE custom_model_requests counter" in text
    assert "# HELP custom_model_last_value Last X seen" in text
    assert "# TYPE custom_model_values histogram" in text
    values = _metric_lines(server, "custom_model_requests")
    assert values[f"custom_model_requests{{{labels}}}"] == 20
    assert _metric_lines(server, "custom_model_last_value")[f"custom_model_last_value{{{labels}}}"] in (
        0.5,
        5.0,
        50.0,
        500.0,
    )
    hist = _metric_lines(server, "custom_model_values")
    assert hist[f'custom_model_values_bucket{{{labels},le="1"}}'] == 5
    assert hist[f'custom_model_values_bucket{{{labels},le="10"}}'] == 10
    assert hist[f'custom_model_values_bucket{{{labels},le="100"}}'] == 15
    assert hist[f'custom_model_values_bucket{{{labels},le="+Inf"}}'] == 20
    assert hist[f"custom_model_values_count{{{labels}}}"] == 20
    assert hist[f"custom_model_values_sum{{{labels}}}"] == pytest.approx(5 * 555.5)


def test_custom_metrics_go_with_the_model_that_made_them(server, client):
    """As in Triton, where they die with the model's Python objects: an unloaded model's series leave /metrics."""
    client.infer("metrics_thread", [_scalar("X", 1.0, "FP32")])
    client.infer("metrics_process", [_scalar("X", 1.0, "FP32")])
    assert any('model="metrics_process"' in k for k in _metric_lines(server, "custom_model_requests"))
    client.unload_model("metrics_process")
    series = _metric_lines(server, "custom_model_requests")
    assert not any('model="metrics_process"' in k for k in series), series
    assert any('model="metrics_thread"' in k for k in series), series  # the family stays while one holds it
    client.unload_model("metrics_thread")
    text = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
    assert "custom_model_" not in text
    # a model loaded again starts its metrics afresh
    client.load_model("metrics_thread")
    result = client.infer("metrics_thread", [_scalar("X", 1.0, "FP32")])
    assert float(result.as_numpy("COUNT")[0]) == 1


# ---- auto_complete_config: pb_utils.ModelConfig in its real role ----

AUTO = r"""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config
        assert isinstance(config, pb_utils.ModelConfig)
        config.set_max_batch_size(8)
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [3]})
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [3], "optional": False})
        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]})
        config.set_dynamic_batching()
        config.set_model_transaction_policy(dict(decoupled=False))
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", 2 * r.inputs()[0].as_numpy())]) for r in requests]
"""


def test_auto_complete_config_completes_the_served_config(server, repo):
    (repo / "auto" / "1").mkdir(parents=True)
    (repo / "auto" / "1" / "model.py").write_text(AUTO)
    (repo / "auto" / "config.pbtxt").write_text('backend: "python"\n')
    client = httpclient.InferenceServerClient(server.http)
    try:
        client.load_model("auto")
        config = client.get_model_config("auto")
        assert config["max_batch_size"] == 8 and "dynamic_batching" in config
        assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("IN", "TYPE_FP32", [3])]
        assert [(t["name"], t["dims"]) for t in config["output"]] == [("OUT", [3])]
        inp = httpclient.InferInput("IN", [2, 3], "FP32")
        inp.set_data_from_numpy(np.ones((2, 3), np.float32))
        assert client.infer("auto", [inp]).as_numpy("OUT").tolist() == [[2.0] * 3] * 2
    finally:
        client.close()


# ---- model control from a model ----


@pytest.mark.parametrize("mode", MODES)
def test_load_unload_and_readiness_from_a_model(client, mode):
    def control(action: str, target: str = "spare") -> bool:
        result = client.infer(f"controller_{mode}", [_bytes("ACTION", action), _bytes("TARGET", target)])
        return bool(result.as_numpy("READY")[0])

    assert control("ready") is True
    assert control("unload") is False
    assert not client.is_model_ready("spare")
    assert control("load") is True
    assert client.is_model_ready("spare")
    assert control("load_config") is True
    assert client.get_model_config("spare")["max_batch_size"] == 2
    with pytest.raises(InferenceServerException) as info:
        control("load", "not_in_any_repository")
    assert "not_in_any_repository" in info.value.message()
    assert control("ready") is True
