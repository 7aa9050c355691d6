"""Python models and GPU tensors: FORCE_CPU_ONLY_INPUT_TENSORS ("yes" by default, "no" keeps GPU inputs on the GPU),
`Tensor.is_cpu()`, `to_dlpack()`, and GPU outputs that stay on the device for the next model of an ensemble or a BLS
caller. The CPU tests check the parameter and that the default path is what it was; the `gpu` tests need CUDA."""

from __future__ import annotations

import types
from pathlib import Path

import gpu_models as gm
import numpy as np
import pytest
import tritonclient.http as httpclient
from helpers import NaiadProcess
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from naiad import device_tensors
from naiad.config import parse_text
from naiad.errors import InvalidArgument
from naiad.inference import InferenceRequest, InferenceResponse, OutputTensor

# OUTPUT0: the input back (through Tensor.from_dlpack); IS_CPU: where the input was; ZERO_COPY: whether the memory
# `to_dlpack()` gives is the tensor's own (torch reads both at the same address)
PROBE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            t = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            same = True
            if not t.is_cpu():
                import torch

                same = torch.from_dlpack(t.to_dlpack()).data_ptr() == torch.from_dlpack(t).data_ptr()
                try:
                    t.as_numpy()
                    same = False  # a GPU tensor must refuse as_numpy, as in Triton
                except pb_utils.TritonModelException:
                    pass
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor.from_dlpack("OUTPUT0", t),
                        pb_utils.Tensor("IS_CPU", np.array([t.is_cpu()])),
                        pb_utils.Tensor("ZERO_COPY", np.array([same])),
                    ]
                )
            )
        return responses
"""

# OUTPUT0 = 2 * INPUT0, computed by torch on the GPU and returned as a CUDA tensor
GPU_DOUBLER = """
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            src = torch.from_dlpack(x) if not x.is_cpu() else torch.from_numpy(x.as_numpy())
            y = src.to("cuda") * 2
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("OUTPUT0", y)]))
        return responses
"""

# BLS: calls gpu_doubler and returns its output as it received it, with where it was
BLS_CALLER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            call = pb_utils.InferenceRequest(
                model_name="gpu_doubler",
                inputs=[pb_utils.Tensor("INPUT0", x.as_numpy())],
                requested_output_names=["OUTPUT0"],
            )
            y = pb_utils.get_output_tensor_by_name(call.exec(), "OUTPUT0")
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor.from_dlpack("OUTPUT0", y), pb_utils.Tensor("IS_CPU", np.array([y.is_cpu()]))]
                )
            )
        return responses
"""

IO = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "IS_CPU" data_type: TYPE_BOOL dims: [ 1 ] },
  { name: "ZERO_COPY" data_type: TYPE_BOOL dims: [ 1 ] }
]
"""


def _param(value: str | None) -> str:
    if value is None:
        return ""
    return f'parameters {{ key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: {{ string_value: "{value}" }} }}'


def _python_model(repo: Path, name: str, code: str, io: str, extra: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n{io}\n{extra}'
    )


def _repo(root: Path) -> Path:
    repo = root / "models"
    for name, value in (("probe_default", None), ("probe_yes", "yes"), ("probe_no", "no")):
        _python_model(repo, name, PROBE, IO, _param(value))
    return repo


def _probe(server, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    client = httpclient.InferenceServerClient(server.http)
    try:
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(model, [inp])
        return {o: result.as_numpy(o) for o in ("OUTPUT0", "IS_CPU", "ZERO_COPY")}
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------------------------
# CPU: the parameter, and the default path
# ---------------------------------------------------------------------------------------------------------------


def _config(text: str) -> mc.ModelConfig:
    return parse_text(text, "test")


@pytest.mark.parametrize(
    "extra, force, takes",
    [
        ("", True, False),
        (_param("yes"), True, False),
        (_param("no"), False, True),
        # worker processes receive tensors through host memory
        (
            _param("no") + ' parameters { key: "EXECUTION_ISOLATION" value: { string_value: "process" } }',
            False,
            False,
        ),
        (_param("no") + " instance_group [ { count: 2 kind: KIND_CPU } ]", False, False),
    ],
)
def test_parameter_values(extra, force, takes):
    config = _config(f'name: "m" backend: "python" {extra}')
    assert device_tensors.force_cpu_only(config) is force
    assert device_tensors.takes_device_inputs(config) is takes


def test_ensembles_take_device_inputs_and_other_backends_do_not():
    assert device_tensors.takes_device_inputs(_config('name: "e" platform: "ensemble"'))
    assert not device_tensors.takes_device_inputs(_config(f'name: "o" backend: "onnxruntime" {_param("no")}'))


@pytest.mark.parametrize("value", ["No", "false", "", "maybe"])
def test_a_bad_value_is_refused(value):
    with pytest.raises(InvalidArgument, match=f"Incorrect value for FORCE_CPU_ONLY_INPUT_TENSORS: {value}'"):
        device_tensors.force_cpu_only(_config(f'name: "m" backend: "python" {_param(value)}'))


def test_a_bad_value_fails_the_load(tmp_path):
    repo = tmp_path / "models"
    _python_model(repo, "bad", PROBE, IO, _param("maybe"))
    _python_model(repo, "good", PROBE, IO, _param("no"))
    server = NaiadProcess(repo, "--model-control-mode", "explicit")
    server.start()
    client = httpclient.InferenceServerClient(server.http)
    try:
        with pytest.raises(
            InferenceServerException, match="Incorrect value for FORCE_CPU_ONLY_INPUT_TENSORS: maybe'"
        ):
            client.load_model("bad")
        assert not client.is_model_ready("bad")
        client.load_model("good")
        assert client.is_model_ready("good")
    finally:
        client.close()
        server.stop()


@pytest.fixture(scope="module")
def cpu_server(tmp_path_factory):
    server = NaiadProcess(_repo(tmp_path_factory.mktemp("gpu_tensors")))
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("model", ["probe_default", "probe_yes", "probe_no"])
def test_host_inputs_stay_host_tensors(cpu_server, model):
    """Inputs sent in the request body are in host memory: every model sees CPU tensors, whatever the parameter."""
    x = np.array([1.5, -2.0, 3.25, 0.0], np.float32)
    got = _probe(cpu_server, model, x)
    np.testing.assert_array_equal(got["OUTPUT0"], x)
    assert got["IS_CPU"].tolist() == [True] and got["ZERO_COPY"].tolist() == [True]


class _LazyInput:
    """Stands in for a CUDA shared-memory input (cuda.CudaInput): records which copy the server asks for."""

    def __init__(self, log: list[str]):
        self.log = log
        self.shape = (4,)

    def to_host(self) -> np.ndarray:
        self.log.append("host")
        return np.zeros(4, np.float32)

    def to_device(self):
        self.log.append("device")
        return np.zeros(4, np.float32)


@pytest.mark.parametrize(
    "config, wanted",
    [
        ('name: "m" backend: "python"', ["host"]),
        (f'name: "m" backend: "python" {_param("yes")}', ["host"]),
        (f'name: "m" backend: "python" {_param("no")}', ["device"]),
        (f'name: "m" backend: "onnxruntime" {_param("no")}', ["host"]),
        ('name: "e" platform: "ensemble"', []),  # passed on as it is: each step's model decides
    ],
)
def test_place_inputs_copies_as_the_model_takes_them(config, wanted):
    log: list[str] = []
    request = InferenceRequest("m", {"INPUT0": _LazyInput(log)}, {"INPUT0": "FP32"}, device_inputs=True)
    device_tensors.place_inputs(request, _config(config))
    assert log == wanted
    if wanted == ["host"]:
        assert isinstance(request.inputs["INPUT0"], np.ndarray) and not request.device_inputs


def test_outputs_to_host():
    class OnDevice:
        def to_host(self):
            return np.ones(2, np.float32)

    response = InferenceResponse(
        "m",
        "1",
        [OutputTensor("A", "FP32", OnDevice()), OutputTensor("B", "FP32", np.zeros(1, np.float32))],
        device_outputs=True,
    )
    device_tensors.outputs_to_host(response)
    assert [o.data.tolist() for o in response.outputs] == [[1.0, 1.0], [0.0]] and not response.device_outputs


def test_host_tensors_are_not_device_tensors():
    import torch

    assert not device_tensors.is_device(np.zeros(2)) and not device_tensors.is_device(torch.zeros(2))
    assert device_tensors.is_device(types.SimpleNamespace(__dlpack_device__=lambda: (2, 0)))


# ---------------------------------------------------------------------------------------------------------------
# GPU: CUDA shared memory inputs, an ensemble's GPU step, BLS
# ---------------------------------------------------------------------------------------------------------------


GPU_REASON = gm.torch_gpu_reason()


def gpu_test(fn):
    """Marked `gpu`; skipped with a one-line reason when no CUDA device is present."""
    return pytest.mark.gpu(pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")(fn))


ENSEMBLE = """
name: "double_then_probe"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "IS_CPU" data_type: TYPE_BOOL dims: [ 1 ] },
  { name: "ZERO_COPY" data_type: TYPE_BOOL dims: [ 1 ] }
]
ensemble_scheduling { step [
  { model_name: "gpu_doubler" model_version: -1
    input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "DOUBLED" } },
  { model_name: "%s" model_version: -1
    input_map { key: "INPUT0" value: "DOUBLED" }
    output_map [ { key: "OUTPUT0" value: "OUT" }, { key: "IS_CPU" value: "IS_CPU" }, { key: "ZERO_COPY" value: "ZERO_COPY" } ] }
] }
"""


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    if GPU_REASON is not None:
        pytest.skip(GPU_REASON)
    repo = _repo(tmp_path_factory.mktemp("gpu_tensors_gpu"))
    one_out = (
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]'
    )
    _python_model(
        repo, "gpu_doubler", GPU_DOUBLER, one_out, _param("no") + " instance_group [ { kind: KIND_GPU } ]"
    )
    bls_io = (
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, '
        '{ name: "IS_CPU" data_type: TYPE_BOOL dims: [ 1 ] } ]'
    )
    _python_model(repo, "bls_no", BLS_CALLER, bls_io, _param("no"))
    _python_model(repo, "bls_default", BLS_CALLER, bls_io)
    for probe in ("probe_no", "probe_default"):
        name = f"double_then_{probe}"
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text((ENSEMBLE % probe).replace("double_then_probe", name))
    server = NaiadProcess(repo)
    server.start()
    yield server
    server.stop()


@gpu_test
@pytest.mark.parametrize(
    "model, on_gpu", [("probe_no", True), ("probe_default", False), ("probe_yes", False)]
)
@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_cuda_shared_memory_input_reaches_the_model_where_it_asks(gpu_server, model, on_gpu, proto):
    import tritonclient.grpc as grpcclient

    from naiad import cuda_runtime

    reason = cuda_runtime.cuda_unavailable_reason()  # the test's own region needs cuda-python
    if reason is not None:
        pytest.skip(reason)
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    region = gm.DeviceRegion(x.nbytes)
    region.write(x)
    mod, addr = (httpclient, gpu_server.http) if proto == "http" else (grpcclient, gpu_server.grpc)
    client = mod.InferenceServerClient(addr)
    name = f"in_{model}_{proto}"
    try:
        client.register_cuda_shared_memory(name, region.b64, 0, x.nbytes)
        inp = mod.InferInput("INPUT0", [4], "FP32")
        inp.set_shared_memory(name, x.nbytes)
        result = client.infer(model, [inp])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)
        assert result.as_numpy("IS_CPU").tolist() == [not on_gpu]
        assert result.as_numpy("ZERO_COPY").tolist() == [True]
    finally:
        client.unregister_cuda_shared_memory(name)
        client.close()
        region.free()


@gpu_test
@pytest.mark.parametrize("probe, on_gpu", [("probe_no", True), ("probe_default", False)])
def test_gpu_step_output_goes_to_the_next_step_as_it_is(gpu_server, probe, on_gpu):
    x = np.array([1.0, -2.0, 0.5, 8.0], np.float32)
    client = httpclient.InferenceServerClient(gpu_server.http)
    try:
        inp = httpclient.InferInput("IN", [4], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(f"double_then_{probe}", [inp])
    finally:
        client.close()
    np.testing.assert_array_equal(result.as_numpy("OUT"), 2 * x)  # copied to the host for the response only
    assert result.as_numpy("IS_CPU").tolist() == [not on_gpu]


@gpu_test
@pytest.mark.parametrize("model, on_gpu", [("bls_no", True), ("bls_default", False)])
def test_bls_response_keeps_gpu_outputs_for_a_model_that_takes_them(gpu_server, model, on_gpu):
    x = np.array([3.0, 1.0, -1.0, 0.25], np.float32)
    client = httpclient.InferenceServerClient(gpu_server.http)
    try:
        inp = httpclient.InferInput("INPUT0", [4], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(model, [inp])
    finally:
        client.close()
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * x)
    assert result.as_numpy("IS_CPU").tolist() == [not on_gpu]


# ---------------------------------------------------------------------------------------------------------------
# CPU: the holder and the routing, with a DeviceTensor over host memory standing in for GPU memory
# ---------------------------------------------------------------------------------------------------------------


def test_device_tensor_holder():
    import torch

    t = device_tensors.DeviceTensor(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert t.shape == (2, 3) and t.ndim == 2 and t.size == 6 and t.nbytes == 24 and t.dtype == np.float32
    assert t.reshape(3, 2).shape == (3, 2) and t[1:].shape == (1, 3)
    np.testing.assert_array_equal(t.to_host(), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert device_tensors.DeviceTensor(torch.ones(2, dtype=torch.bool)).dtype == np.bool_
    bf16 = device_tensors.DeviceTensor(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    assert bf16.dtype == np.uint16 and bf16.to_host().tolist() == [
        0x3F80,
        0xC000,
    ]  # BF16 words, as on the host


def test_pb_utils_tensor_over_device_memory():
    import torch

    from naiad.backends.python import triton_python_backend_utils as pb_utils

    held = device_tensors.DeviceTensor(torch.arange(4, dtype=torch.int32))
    t = pb_utils.Tensor("X", held)
    assert not t.is_cpu() and t.shape() == [4] and t.name() == "X"
    with pytest.raises(
        pb_utils.TritonModelException, match="Tensor is stored in GPU and cannot be converted to NumPy"
    ):
        t.as_numpy()
    assert torch.from_dlpack(t.to_dlpack()).data_ptr() == held.torch.data_ptr()  # no copy


ENSEMBLE_OF = """
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "IS_CPU" data_type: TYPE_BOOL dims: [ 1 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "{step}" model_version: -1 input_map {{ key: "INPUT0" value: "IN" }}
    output_map [ {{ key: "OUTPUT0" value: "OUT" }}, {{ key: "IS_CPU" value: "IS_CPU" }} ] }}
] }}
"""


@pytest.mark.parametrize(
    "model, on_device",
    [
        ("probe_no", True),
        ("probe_default", False),
        ("probe_yes", False),
        ("ens_probe_no", True),
        ("ens_probe_default", False),
    ],
)
async def test_server_routes_device_inputs_by_the_model(tmp_path, model, on_device):
    """In-process: a device-held input reaches a "no" model as it is (directly or through an ensemble step) and
    every other model as host memory; the response leaves Server.infer in host memory."""
    import torch

    from naiad.server import Server, ServerOptions

    repo = _repo(tmp_path)
    for probe in ("probe_no", "probe_default"):
        (repo / f"ens_{probe}" / "1").mkdir(parents=True)
        (repo / f"ens_{probe}" / "config.pbtxt").write_text(
            ENSEMBLE_OF.format(name=f"ens_{probe}", step=probe)
        )
    server = Server(ServerOptions(model_repositories=[str(repo)]))
    await server.start()
    try:
        x = torch.tensor([1.0, 2.0, -3.0, 0.5])
        name = "IN" if model.startswith("ens_") else "INPUT0"
        request = InferenceRequest(
            model, {name: device_tensors.DeviceTensor(x)}, {name: "FP32"}, device_inputs=True
        )
        response = await server.infer(request)
        outputs = {o.name: o.data for o in response.outputs}
        assert all(isinstance(v, np.ndarray) for v in outputs.values()) and not response.device_outputs
        np.testing.assert_array_equal(outputs["OUT" if name == "IN" else "OUTPUT0"], x.numpy())
        assert outputs["IS_CPU"].tolist() == [not on_device]
    finally:
        await server.stop()
