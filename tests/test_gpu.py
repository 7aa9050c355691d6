"""GPU support.

Tests marked `gpu` need a CUDA device and skip, each with a one-line reason, without one (`make test-gpu` runs
only them). The others run anywhere: KIND_GPU refusal without a GPU, the tensorrt backend's errors without
tensorrt, `device_count()`, the CUDA shared memory endpoints on a server without a GPU, and the TensorRT
instance and CUDA shared memory manager driven through stand-ins for `tensorrt` and the CUDA runtime whose
"device memory" is host memory (same calls, same argument and result shapes as the real bindings).
"""

from __future__ import annotations

import base64
import collections
import ctypes
import enum
import json
import sys
import types
from pathlib import Path

import gpu_models as gm
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from build_models import export_onnx, mlp
from helpers import NaiadProcess, free_ports
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from naiad import backends, cuda_runtime, gpu, shared_memory
from naiad.backends.base import ModelContext
from naiad.config import normalize, parse_text
from naiad.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from naiad.shared_memory import cuda as cuda_shm

GPU_REASON = gm.cuda_device_reason()


def gpu_test(fn):
    """Marked `gpu`; skipped with a one-line reason when no CUDA device is present."""
    return pytest.mark.gpu(pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")(fn))


no_gpu_only = pytest.mark.skipif(
    GPU_REASON is None, reason="checks the no-GPU behaviour; a CUDA device is present"
)


# =====================================================================================================
# Stand-ins for cuda-python's runtime and for tensorrt (CPU tests)
# =====================================================================================================


class _Err(enum.Enum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorInvalidResourceHandle = 400


class _Kind(enum.Enum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class _Stream:
    def __init__(self, n):
        self.n = n

    def __int__(self):
        return self.n


class FakeCudart:
    """cuda.bindings.runtime's calls that naiad uses, returning `(error, *values)`; memory is host memory."""

    cudaError_t = _Err
    cudaMemcpyKind = _Kind
    cudaStreamNonBlocking = 1
    cudaIpcMemLazyEnablePeerAccess = 1

    class cudaIpcMemHandle_t:
        def __init__(self):
            self._buf = ctypes.create_string_buffer(64)

        def getPtr(self):
            return ctypes.addressof(self._buf)

    def __init__(self, devices: int = 1):
        self.devices = devices
        self.device_mem: dict[int, ctypes.Array] = {}
        self.host_mem: dict[int, ctypes.Array] = {}
        self.ipc: dict[bytes, int] = {}
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.streams: set[int] = set()
        self.calls = collections.Counter()
        self.current = 0

    def _ok(self, *values):
        return (_Err.cudaSuccess, *values)

    def cudaGetErrorString(self, err):
        return self._ok(err.name.encode())

    def cudaGetDeviceCount(self):
        return self._ok(self.devices)

    def cudaSetDevice(self, d):
        if d >= self.devices:
            return (_Err.cudaErrorInvalidValue,)
        self.current = d
        return self._ok()

    def cudaMalloc(self, n):
        buf = ctypes.create_string_buffer(n)
        self.device_mem[ctypes.addressof(buf)] = buf
        self.calls["cudaMalloc"] += 1
        return self._ok(ctypes.addressof(buf))

    def cudaFree(self, p):
        del self.device_mem[p]
        return self._ok()

    def cudaMallocHost(self, n):
        buf = ctypes.create_string_buffer(n)
        self.host_mem[ctypes.addressof(buf)] = buf
        self.calls["cudaMallocHost"] += 1
        return self._ok(ctypes.addressof(buf))

    def cudaFreeHost(self, p):
        del self.host_mem[p]
        return self._ok()

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        assert int(stream) in self.streams
        return self.cudaMemcpy(dst, src, n, kind)

    def cudaMemcpy(self, dst, src, n, kind):
        ctypes.memmove(int(dst), int(src), n)
        self.calls[kind.name] += 1
        return self._ok()

    def cudaStreamCreateWithFlags(self, flags):
        s = _Stream(len(self.streams) + 1000)
        self.streams.add(int(s))
        return self._ok(s)

    def cudaStreamSynchronize(self, s):
        self.calls["sync"] += 1
        return self._ok()

    def cudaStreamDestroy(self, s):
        self.streams.discard(int(s))
        return self._ok()

    # CUDA IPC: a "handle" is the pointer's bytes, padded to 64
    def cudaIpcGetMemHandle(self, ptr):
        h = self.cudaIpcMemHandle_t()
        raw = int(ptr).to_bytes(8, "little") * 8
        ctypes.memmove(h.getPtr(), raw, 64)
        self.ipc[raw] = int(ptr)
        return self._ok(h)

    def cudaIpcOpenMemHandle(self, handle, flags):
        raw = ctypes.string_at(handle.getPtr(), 64)
        if raw not in self.ipc:
            return (_Err.cudaErrorInvalidResourceHandle, None)
        self.opened.append(self.ipc[raw])
        return self._ok(self.ipc[raw])

    def cudaIpcCloseMemHandle(self, ptr):
        self.closed.append(int(ptr))
        return self._ok()

    def leaks(self) -> int:
        return len(self.device_mem) + len(self.host_mem) + len(self.streams)


def _fake_tensorrt() -> types.ModuleType:
    """The slice of the TensorRT 10 Python API the backend uses; a plan is JSON (weights, batch profiles)."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.fake"

    class ILogger:
        class Severity(enum.Enum):
            INTERNAL_ERROR = 0
            ERROR = 1
            WARNING = 2
            INFO = 3
            VERBOSE = 4

        def __init__(self):
            pass

    trt.ILogger = ILogger
    trt.TensorIOMode = enum.Enum("TensorIOMode", "NONE INPUT OUTPUT")
    trt.TensorLocation = enum.Enum("TensorLocation", "DEVICE HOST")
    trt.DataType = enum.Enum("DataType", "FLOAT HALF INT8 INT32 BOOL UINT8 FP8 BF16 INT64 INT4")

    class Context:
        def __init__(self, engine):
            self.engine, self.profile, self.shapes, self.addr = engine, 0, {}, {}
            self.profile_switches = 0

        def set_optimization_profile_async(self, p, stream):
            self.profile, self.shapes = p, {}
            self.profile_switches += 1
            return True

        def set_input_shape(self, name, shape):
            lo, _, hi = self.engine.get_tensor_profile_shape(name, self.profile)
            if len(shape) != 2 or not (lo[0] <= shape[0] <= hi[0]) or shape[1] != self.engine.features:
                return False
            self.shapes[name] = tuple(shape)
            return True

        def get_tensor_shape(self, name):
            if name == "input":
                return self.shapes.get("input", (-1, self.engine.features))
            return (self.shapes["input"][0], self.engine.classes) if "input" in self.shapes else (-1, -1)

        def set_tensor_address(self, name, ptr):
            self.addr[name] = ptr

        def execute_async_v3(self, stream):
            n, f = self.shapes["input"]
            x = np.frombuffer((ctypes.c_float * (n * f)).from_address(self.addr["input"]), np.float32)
            y = (x.reshape(n, f) @ self.engine.weights).astype(np.float32)
            ctypes.memmove(self.addr["output"], y.ctypes.data, y.nbytes)
            self.engine.executions += 1
            return True

    class Engine:
        def __init__(self, spec):
            self.features, self.classes = spec["features"], spec["classes"]
            self.weights = np.asarray(spec["weights"], dtype=np.float32)
            self.profiles = spec["profiles"]
            self.executions = 0

        num_io_tensors = 2

        @property
        def num_optimization_profiles(self):
            return len(self.profiles)

        def get_tensor_name(self, i):
            return ["input", "output"][i]

        def get_tensor_mode(self, name):
            return trt.TensorIOMode.INPUT if name == "input" else trt.TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name):
            return trt.DataType.FLOAT

        def get_tensor_shape(self, name):
            return (-1, self.features if name == "input" else self.classes)

        def get_tensor_location(self, name):
            return trt.TensorLocation.DEVICE

        def is_shape_inference_io(self, name):
            return False

        def get_tensor_profile_shape(self, name, p):
            lo, opt, hi = self.profiles[p]
            return [(lo, self.features), (opt, self.features), (hi, self.features)]

        def create_execution_context(self):
            return Context(self)

    class Runtime:
        def __init__(self, logger):
            assert isinstance(logger, ILogger)

        def deserialize_cuda_engine(self, data):
            try:
                return Engine(json.loads(data))
            except ValueError:
                return None

    trt.Runtime = Runtime
    return trt


WEIGHTS = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)


def _fake_plan(path: Path, profiles=((1, 8, 16), (17, 24, 32))) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "features": 16,
                "classes": 8,
                "weights": WEIGHTS.tolist(),
                "profiles": [list(p) for p in profiles],
            }
        )
    )
    return path


@pytest.fixture()
def fake_cuda(monkeypatch):
    rt = FakeCudart()
    monkeypatch.setattr(cuda_runtime, "cudart", lambda: rt)
    monkeypatch.setattr(gpu, "device_count", lambda: rt.devices)
    monkeypatch.setattr(cuda_runtime, "allocation_size", lambda ptr: None)
    return rt


@pytest.fixture()
def fake_trt(monkeypatch, fake_cuda):
    trt = _fake_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    return trt


def _plan_ctx(tmp_path: Path, config_text: str) -> ModelContext:
    config = parse_text(config_text)
    config.backend = config.backend or "tensorrt"
    config.default_model_filename = config.default_model_filename or "model.plan"
    return ModelContext(
        name=config.name,
        version=1,
        config=config,
        model_dir=tmp_path / config.name,
        version_dir=tmp_path / config.name / "1",
    )


# =====================================================================================================
# CPU-runnable checks
# =====================================================================================================


def test_normalize_refuses_kind_gpu_without_gpu():
    config = parse_text('name: "m" backend: "onnxruntime" instance_group [ { kind: KIND_GPU } ]')
    with pytest.raises(
        InvalidArgument, match=r"model 'm': instance group 'm' is KIND_GPU but no GPU is available"
    ):
        normalize(config, gpu_count=0)
    auto = parse_text('name: "m" backend: "onnxruntime"')
    normalize(auto, gpu_count=0)
    assert auto.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    on_two = parse_text('name: "m" backend: "onnxruntime" instance_group [ { kind: KIND_GPU } ]')
    normalize(on_two, gpu_count=2)
    assert list(on_two.instance_group[0].gpus) == [0, 1]
    wrong = parse_text('name: "m" backend: "onnxruntime" instance_group [ { kind: KIND_GPU gpus: [ 3 ] } ]')
    with pytest.raises(InvalidArgument, match="names GPU 3, but only 2 GPU"):
        normalize(wrong, gpu_count=2)


def test_device_count_is_zero_without_nvml_and_never_raises(monkeypatch):
    n = gpu.device_count()
    assert isinstance(n, int) and n >= 0
    if GPU_REASON is not None:
        assert n == 0
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert gpu.device_count() == 0
    assert gpu.devices() == []


def test_device_count_respects_cuda_visible_devices(monkeypatch):
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: 4
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    for value, expected in (
        (None, 4),
        ("", 0),
        ("-1", 0),
        ("1", 1),
        ("0,2", 2),
        ("0,7,1", 1),
        ("3,3", 1),
        ("GPU-8a1c", 1),
    ):
        if value is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert gpu.device_count() == expected, value

    def broken():
        raise RuntimeError("NVML Shared Library Not Found")

    fake.nvmlInit = broken
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu.device_count() == 0


def test_tensorrt_backend_reports_missing_tensorrt(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    module = backends.get("tensorrt")
    plan = tmp_path / "m" / "1" / "model.plan"
    plan.parent.mkdir(parents=True)
    plan.write_bytes(b"not a plan")
    message = (
        r"the tensorrt backend needs the 'tensorrt' package \(TensorRT >= 10\): "
        r"pip install 'naiad\[tensorrt\]'"
    )
    with pytest.raises(Unavailable, match=message):
        module.auto_complete(parse_text('name: "m" platform: "tensorrt_plan"'), plan)
    ctx = _plan_ctx(tmp_path, 'name: "m" platform: "tensorrt_plan" instance_group [ { kind: KIND_GPU } ]')
    with pytest.raises(Unavailable, match=message):
        module.create_instance(ctx, ctx.config.instance_group[0], 0, 0)


def test_tensorrt_backend_reports_missing_cuda_python_and_gpu(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt())
    module = backends.get("tensorrt")
    plan = _fake_plan(tmp_path / "m" / "1" / "model.plan")

    def no_cuda():
        raise Unavailable("CUDA support needs the 'cuda-python' package: pip install 'naiad[tensorrt]'")

    monkeypatch.setattr(cuda_runtime, "cudart", no_cuda)
    with pytest.raises(Unavailable, match="cuda-python"):
        module.auto_complete(parse_text('name: "m"'), plan)
    monkeypatch.setattr(cuda_runtime, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(gpu, "device_count", lambda: 0)
    with pytest.raises(Unavailable, match="needs a CUDA GPU and none is available"):
        module.auto_complete(parse_text('name: "m"'), plan)


def test_tensorrt_backend_refuses_cpu_instances(fake_trt, tmp_path):
    _fake_plan(tmp_path / "m" / "1" / "model.plan")
    ctx = _plan_ctx(tmp_path, 'name: "m" platform: "tensorrt_plan" instance_group [ { kind: KIND_CPU } ]')
    with pytest.raises(
        InvalidArgument, match="KIND_CPU, but the tensorrt backend only runs on GPU instances"
    ):
        backends.get("tensorrt").create_instance(ctx, ctx.config.instance_group[0], 0, 0)


def test_tensorrt_auto_complete_from_engine(fake_trt, tmp_path):
    module = backends.get("tensorrt")
    plan = _fake_plan(tmp_path / "m" / "1" / "model.plan")
    config = parse_text('name: "m" platform: "tensorrt_plan"')
    module.auto_complete(config, plan)
    assert config.max_batch_size == 32  # the largest first dim any profile admits
    assert config.HasField("dynamic_batching")
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("input", mc.TYPE_FP32, [16])]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [("output", mc.TYPE_FP32, [8])]
    # A config that names its tensors keeps max_batch_size 0: the engine's dims are then taken whole.
    explicit = parse_text('name: "m" input [ { name: "input" data_type: TYPE_FP32 dims: [ -1, 16 ] } ]')
    module.auto_complete(explicit, plan)
    assert explicit.max_batch_size == 0
    assert [list(t.dims) for t in explicit.output] == [[-1, 8]]
    junk = tmp_path / "m" / "2" / "model.plan"
    junk.parent.mkdir()
    junk.write_bytes(b"junk")
    with pytest.raises(
        InvalidArgument, match="failed to deserialize TensorRT plan .* \\(this is TensorRT 10.fake\\)"
    ):
        module.auto_complete(parse_text('name: "m"'), junk)


def test_tensorrt_instance_profiles_and_buffers(fake_trt, fake_cuda, tmp_path):
    module = backends.get("tensorrt")
    _fake_plan(tmp_path / "m" / "1" / "model.plan")
    ctx = _plan_ctx(
        tmp_path, 'name: "m" platform: "tensorrt_plan" instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]'
    )
    module.auto_complete(ctx.config, ctx.version_dir / "model.plan")
    normalize(ctx.config, gpu_count=1)
    inst = module.create_instance(ctx, ctx.config.instance_group[0], 0, 0)
    rng = np.random.default_rng(1)

    def run(batch, outputs=("output",)):
        x = rng.standard_normal((batch, 16)).astype(np.float32)
        out = inst.run({"input": x}, list(outputs))
        if outputs:
            np.testing.assert_allclose(out["output"], x @ WEIGHTS, rtol=1e-5, atol=1e-5)
            assert out["output"].flags.owndata  # not a view of the reused pinned buffer
        return out

    first = run(4)
    second = run(4)
    assert first["output"] is not second["output"]
    allocs = (fake_cuda.calls["cudaMalloc"], fake_cuda.calls["cudaMallocHost"])
    run(3)
    assert (fake_cuda.calls["cudaMalloc"], fake_cuda.calls["cudaMallocHost"]) == allocs  # reused
    before = dict(fake_cuda.calls)
    run(16)
    assert fake_cuda.calls["cudaMalloc"] > before["cudaMalloc"]  # grown for the larger batch
    # one host->device copy per input, one device->host copy per wanted output, one stream sync per run
    assert fake_cuda.calls["cudaMemcpyHostToDevice"] - before["cudaMemcpyHostToDevice"] == 1
    assert fake_cuda.calls["cudaMemcpyDeviceToHost"] - before["cudaMemcpyDeviceToHost"] == 1
    assert fake_cuda.calls["sync"] - before["sync"] == 1
    assert inst.profile == 0
    run(20)  # only profile 1 (17..32) admits 20
    assert inst.profile == 1 and inst.context.profile == 1
    run(20)
    assert inst.context.profile_switches == 1  # the current profile is kept while it fits
    run(2)
    assert inst.profile == 0
    with pytest.raises(
        InvalidArgument,
        match=r"fit none of the TensorRT engine's optimisation profiles "
        r"\(profile 0: input \[1, 16\]\.\.\[16, 16\]; profile 1",
    ):
        inst.run({"input": np.zeros((40, 16), np.float32)}, ["output"])
    with pytest.raises(InvalidArgument, match="input 'input' is missing"):
        inst.run({}, ["output"])
    # fp64 from a client is converted to the engine's type
    x = rng.standard_normal((2, 16))
    np.testing.assert_allclose(
        inst.run({"input": x}, ["output"])["output"], x.astype(np.float32) @ WEIGHTS, rtol=1e-5, atol=1e-5
    )
    assert fake_cuda.current == 0
    inst.close()
    inst.close()
    assert fake_cuda.leaks() == 0
    with pytest.raises(Unavailable, match="is closed"):
        inst.run({"input": np.zeros((1, 16), np.float32)}, ["output"])


def test_tensorrt_instance_validates_config_against_engine(fake_trt, tmp_path):
    module = backends.get("tensorrt")
    _fake_plan(tmp_path / "m" / "1" / "model.plan")
    base = 'name: "m" platform: "tensorrt_plan" instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ] '
    cases = [
        (
            'max_batch_size: 64 input [ { name: "input" data_type: TYPE_FP32 dims: [ 16 ] } ]',
            (
                "max_batch_size 64 exceeds the largest batch the TensorRT engine's optimisation profiles "
                "allow \\(32\\)"
            ),
        ),
        (
            'max_batch_size: 8 input [ { name: "input" data_type: TYPE_FP16 dims: [ 16 ] } ]',
            "input 'input' is TYPE_FP16 in the config but TYPE_FP32 in the TensorRT engine",
        ),
        (
            (
                'max_batch_size: 8 input [ { name: "input" data_type: TYPE_FP32 dims: [ 16 ] } ] '
                'output [ { name: "logits" data_type: TYPE_FP32 dims: [ 8 ] } ]'
            ),
            "output 'logits' is not an output of the TensorRT engine \\(engine outputs: output\\)",
        ),
        (
            'max_batch_size: 8 output [ { name: "output" data_type: TYPE_FP32 dims: [ 8 ] } ]',
            "the TensorRT engine's inputs \\['input'\\] are not declared in the config",
        ),
    ]
    for extra, message in cases:
        ctx = _plan_ctx(tmp_path, base + extra)
        with pytest.raises(InvalidArgument, match=message):
            module.create_instance(ctx, ctx.config.instance_group[0], 0, 0)


# ---- CUDA shared memory manager, on the stand-in runtime ----


def _client_region(rt: FakeCudart, data: bytes | int):
    """A 'client' allocation and its raw IPC handle."""
    size = data if isinstance(data, int) else len(data)
    ptr = cuda_runtime.check(rt.cudaMalloc(size), "cudaMalloc")
    if not isinstance(data, int):
        ctypes.memmove(ptr, data, size)
    handle = cuda_runtime.check(rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
    return ptr, ctypes.string_at(handle.getPtr(), 64)


def test_cuda_shm_manager_register_read_write_unregister(fake_cuda):
    from naiad import tensors
    from naiad.inference import OutputTensor

    mgr = cuda_shm.SharedMemoryManagerWithCuda(enabled=True, reason=None)
    cuda = mgr.cuda
    x = np.arange(6, dtype=np.float32)
    strings = tensors.serialize_bytes(np.array([b"ab", b"cde"], dtype=object))
    ptr, raw = _client_region(fake_cuda, x.tobytes() + bytes(strings) + bytes(64))
    cuda.register("r", raw, 0, 24 + len(strings) + 64)
    assert cuda.status() == [{"name": "r", "device_id": 0, "byte_size": 24 + len(strings) + 64}]
    assert cuda.status("r")[0]["name"] == "r"
    with pytest.raises(NotFound, match="Unable to find cuda shared memory region: 'nope'"):
        cuda.status("nope")
    with pytest.raises(AlreadyExists):
        cuda.register("r", raw, 0, 8)
    # inputs, through the combined manager (what the frontends call)
    lazy = mgr.read_input(
        "INPUT0", "FP32", [2, 3], {"shared_memory_region": "r", "shared_memory_byte_size": 24}
    )
    # checked now, copied once the model is known (Server.infer): to the host for every model but a python
    # model with FORCE_CPU_ONLY_INPUT_TENSORS "no"
    assert isinstance(lazy, cuda_shm.CudaInput) and lazy.shape == (2, 3) and lazy.dtype == np.float32
    np.testing.assert_array_equal(lazy.to_host(), x.reshape(2, 3))
    got = mgr.read_input(
        "S",
        "BYTES",
        [2],
        {"shared_memory_region": "r", "shared_memory_byte_size": len(strings), "shared_memory_offset": 24},
    )
    assert list(got) == [b"ab", b"cde"]
    with pytest.raises(InvalidArgument, match="does not match the tensor's 24 bytes"):
        mgr.read_input("INPUT0", "FP32", [2, 3], {"shared_memory_region": "r", "shared_memory_byte_size": 20})
    with pytest.raises(InvalidArgument, match="is past the end of the registered region"):
        mgr.read_input(
            "INPUT0",
            "FP32",
            [2, 3],
            {"shared_memory_region": "r", "shared_memory_byte_size": 24, "shared_memory_offset": 1000},
        )
    # outputs
    y = np.array([[1.5, -2.0]], dtype=np.float32)
    params = mgr.write_output(
        OutputTensor("OUT", "FP32", y),
        {
            "shared_memory_region": "r",
            "shared_memory_byte_size": 8,
            "shared_memory_offset": 24 + len(strings),
        },
    )
    assert params == {
        "shared_memory_region": "r",
        "shared_memory_byte_size": 8,
        "shared_memory_offset": 24 + len(strings),
    }
    assert ctypes.string_at(ptr + 24 + len(strings), 8) == y.tobytes()
    with pytest.raises(InvalidArgument, match="holds 4 bytes, the tensor needs 8"):
        mgr.write_output(
            OutputTensor("OUT", "FP32", y), {"shared_memory_region": "r", "shared_memory_byte_size": 4}
        )
    # one name space with system shared memory
    with pytest.raises(AlreadyExists, match="shared memory region 'r' already in manager"):
        mgr.register("r", "/naiad_gpu_test_nonexistent", 0, 8)
    # bad registrations
    with pytest.raises(InvalidArgument, match="must be a 64-byte cudaIpcMemHandle_t \\(got 3\\)"):
        cuda.register("s", b"abc", 0, 8)
    with pytest.raises(InvalidArgument, match="device 3 does not exist \\(1 CUDA device"):
        cuda.register("s", raw, 3, 8)
    with pytest.raises(InvalidArgument, match="cudaIpcOpenMemHandle on device 0 failed"):
        cuda.register("s", bytes(64), 0, 8)
    with pytest.raises(InvalidArgument, match="byte_size' must be greater than zero"):
        cuda.register("s", raw, 0, 0)
    # unregister closes the mapping; later reads fail clearly, also of an input decoded before
    cuda.unregister("r")
    with pytest.raises(InvalidArgument, match="cuda shared memory region 'r' was unregistered"):
        lazy.to_host()
    assert fake_cuda.closed == [ptr] and cuda.status() == []
    with pytest.raises(InvalidArgument, match="Unable to find shared memory region: 'r'"):
        mgr.read_input("INPUT0", "FP32", [2, 3], {"shared_memory_region": "r", "shared_memory_byte_size": 24})
    cuda.register("a", raw, 0, 8)
    cuda.register("b", raw, 0, 8)
    cuda.unregister()
    assert cuda.status() == [] and len(fake_cuda.closed) == 3


def test_cuda_shm_manager_bounds_registration_by_the_allocation(fake_cuda, monkeypatch):
    monkeypatch.setattr(cuda_runtime, "allocation_size", lambda ptr: 16)
    _, raw = _client_region(fake_cuda, 16)
    with pytest.raises(InvalidArgument, match="byte_size 32 exceeds the 16-byte allocation"):
        cuda_shm.CudaSharedMemoryManager().register("r", raw, 0, 32)
    assert len(fake_cuda.closed) == 1


def test_shared_memory_manager_wiring(monkeypatch, fake_cuda):
    from naiad.shared_memory.system import SharedMemoryManager

    server = types.SimpleNamespace(extensions=["a", "system_shared_memory", "b"])
    monkeypatch.setattr(gpu, "device_count", lambda: 0)
    mgr = shared_memory.shared_memory_manager(server)
    assert type(mgr) is SharedMemoryManager and not hasattr(mgr, "cuda")
    assert shared_memory.EXTENSION not in server.extensions
    monkeypatch.setattr(gpu, "device_count", lambda: 1)
    monkeypatch.setattr(cuda_runtime, "cuda_unavailable_reason", lambda: "CUDA broken here")
    mgr = shared_memory.shared_memory_manager(server)
    assert mgr.cuda.reason == "CUDA broken here" and shared_memory.EXTENSION not in server.extensions
    with pytest.raises(InvalidArgument, match="CUDA broken here"):
        mgr.cuda.register("r", bytes(64), 0, 8)
    monkeypatch.setattr(cuda_runtime, "cuda_unavailable_reason", lambda: None)
    mgr = shared_memory.shared_memory_manager(server)
    assert mgr.cuda.available
    assert server.extensions == ["a", "system_shared_memory", "cuda_shared_memory", "b"]
    disabled = shared_memory.shared_memory_manager(types.SimpleNamespace(extensions=[]), enabled=False)
    assert type(disabled) is SharedMemoryManager and not disabled.enabled


async def test_cuda_shm_through_http_and_grpc_frontends(fake_cuda, tmp_path):
    """The frontends' hooks, end to end in-process: register over HTTP and gRPC, infer with inputs and outputs
    in CUDA regions (stand-in runtime), status and unregister."""
    import aiohttp
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    from naiad.frontends.grpc.frontend import GrpcFrontend
    from naiad.frontends.http.frontend import HttpFrontend
    from naiad.server import Server, ServerOptions

    repo = tmp_path / "repo"
    export_onnx(mlp(16, 8), repo / "mlp_cpu" / "1" / "model.onnx", 16)
    (repo / "mlp_cpu" / "config.pbtxt").write_text(
        gm.MLP_CONFIG.format(name="mlp_cpu", kind="KIND_CPU", extra="")
    )
    server = Server(ServerOptions(model_repositories=[str(repo)]))
    shm = cuda_shm.SharedMemoryManagerWithCuda(enabled=True, reason=None)
    await server.start()
    http_port, grpc_port = free_ports(2)
    runner = await HttpFrontend(server, shm=shm).start("127.0.0.1", http_port)
    grpc_frontend = GrpcFrontend(server, shm=shm)
    await grpc_frontend.start("127.0.0.1", grpc_port)
    x = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)
    expected = gm.reference_mlp(x)
    in_ptr, in_raw = _client_region(fake_cuda, x.tobytes())
    out_ptr, out_raw = _client_region(fake_cuda, expected.nbytes)
    url = f"http://127.0.0.1:{http_port}/v2/cudasharedmemory"
    try:
        async with aiohttp.ClientSession() as s:
            body = {
                "raw_handle": {"b64": base64.b64encode(in_raw).decode()},
                "device_id": 0,
                "byte_size": x.nbytes,
            }
            async with s.post(f"{url}/region/in/register", json=body) as r:
                assert r.status == 200, await r.text()
            async with s.post(f"{url}/region/bad/register", json={"raw_handle": {"b64": "%%%"}}) as r:
                assert r.status == 400 and "not valid base64" in (await r.json())["error"]
            async with s.post(f"{url}/region/in/register", json=body) as r:
                assert r.status == 409
            async with s.get(f"{url}/status") as r:
                assert await r.json() == [{"name": "in", "device_id": 0, "byte_size": x.nbytes}]
            async with s.get(f"{url}/region/zzz/status") as r:
                assert r.status == 404
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                await stub.CudaSharedMemoryRegister(
                    pb.CudaSharedMemoryRegisterRequest(
                        name="out", raw_handle=out_raw, device_id=0, byte_size=expected.nbytes
                    )
                )
                status = await stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest())
                assert sorted(status.regions) == ["in", "out"]
                assert status.regions["out"].byte_size == expected.nbytes
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest(name="zzz"))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                # gRPC inference with both tensors in CUDA regions
                req = pb.ModelInferRequest(model_name="mlp_cpu")
                t = req.inputs.add(name="input", datatype="FP32", shape=[3, 16])
                t.parameters["shared_memory_region"].string_param = "in"
                t.parameters["shared_memory_byte_size"].int64_param = x.nbytes
                o = req.outputs.add(name="output")
                o.parameters["shared_memory_region"].string_param = "out"
                o.parameters["shared_memory_byte_size"].int64_param = expected.nbytes
                resp = await stub.ModelInfer(req)
                # As Triton: one empty raw entry per output in shared memory, no output parameters
                assert list(resp.raw_output_contents) == [b""]
                assert not resp.outputs[0].parameters
                got = np.frombuffer(ctypes.string_at(out_ptr, expected.nbytes), np.float32).reshape(3, 8)
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
                ctypes.memset(out_ptr, 0, expected.nbytes)
                # HTTP inference, same regions
                doc = {
                    "inputs": [
                        {
                            "name": "input",
                            "datatype": "FP32",
                            "shape": [3, 16],
                            "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": x.nbytes},
                        }
                    ],
                    "outputs": [
                        {
                            "name": "output",
                            "parameters": {
                                "shared_memory_region": "out",
                                "shared_memory_byte_size": expected.nbytes,
                            },
                        }
                    ],
                }
                async with s.post(f"http://127.0.0.1:{http_port}/v2/models/mlp_cpu/infer", json=doc) as r:
                    assert r.status == 200, await r.text()
                    out = (await r.json())["outputs"][0]
                    assert out == {"name": "output", "datatype": "FP32", "shape": [3, 8]}  # as Triton
                got = np.frombuffer(ctypes.string_at(out_ptr, expected.nbytes), np.float32).reshape(3, 8)
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
                await stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(name="out"))
            async with s.post(f"{url}/unregister") as r:
                assert r.status == 200
            async with s.get(f"{url}/status") as r:
                assert await r.json() == []
        assert sorted(fake_cuda.closed) == sorted([in_ptr, out_ptr])
    finally:
        await server.stop(1.0)
        await grpc_frontend.stop(0.5)
        await runner.cleanup()


# ---- a real `naiad serve` without a GPU ----


@pytest.fixture(scope="module")
def cpu_server(tmp_path_factory):
    """A server on a tiny repository: an ONNX model asking for KIND_GPU, and a TensorRT plan."""
    repo = tmp_path_factory.mktemp("gpu_cpu_repo")
    export_onnx(mlp(16, 8), repo / "onnx_on_gpu" / "1" / "model.onnx", 16)
    (repo / "onnx_on_gpu" / "config.pbtxt").write_text(
        gm.MLP_CONFIG.format(name="onnx_on_gpu", kind="KIND_GPU", extra="")
    )
    (repo / "plan" / "1").mkdir(parents=True)
    (repo / "plan" / "1" / "model.plan").write_bytes(b"\x00" * 64)
    (repo / "plan" / "config.pbtxt").write_text('name: "plan"\nplatform: "tensorrt_plan"\n')
    proc = NaiadProcess(repo, "--strict-readiness", "false")
    proc.start()
    yield proc
    proc.stop()


def _reasons(server) -> dict:
    index = requests.post(f"{server.url}/v2/repository/index", json={}, timeout=10).json()
    return {e["name"]: (e.get("state"), e.get("reason", "")) for e in index}


@no_gpu_only
def test_server_without_gpu_refuses_kind_gpu_and_reports_tensorrt(cpu_server):
    reasons = _reasons(cpu_server)
    assert reasons["onnx_on_gpu"][0] == "UNAVAILABLE"
    assert "instance group 'onnx_on_gpu' is KIND_GPU but no GPU is available" in reasons["onnx_on_gpu"][1]
    state, reason = reasons["plan"]
    assert state == "UNAVAILABLE"
    try:
        import tensorrt  # noqa: F401

        assert "needs a CUDA GPU" in reason
    except ImportError:
        assert "the tensorrt backend needs the 'tensorrt' package" in reason and "naiad[tensorrt]" in reason


@no_gpu_only
def test_cuda_shm_endpoints_without_gpu(cpu_server):
    meta = requests.get(f"{cpu_server.url}/v2", timeout=10).json()
    assert "system_shared_memory" in meta["extensions"]
    assert "cuda_shared_memory" not in meta["extensions"]
    raw = base64.b64encode(bytes(64))
    http = httpclient.InferenceServerClient(cpu_server.http)
    grpc_ = grpcclient.InferenceServerClient(cpu_server.grpc)
    try:
        assert list(grpc_.get_server_metadata().extensions) == meta["extensions"]
        assert http.get_cuda_shared_memory_status() == []
        assert list(grpc_.get_cuda_shared_memory_status().regions) == []
        for client in (http, grpc_):
            with pytest.raises(
                InferenceServerException,
                match="CUDA shared memory is not supported by this server: it needs a CUDA device",
            ):
                client.register_cuda_shared_memory("r", raw, 0, 64)
            # Nothing can be registered, so unregistering succeeds on both protocols, as on Triton.
            client.unregister_cuda_shared_memory("r")
            client.unregister_cuda_shared_memory()
        r = requests.get(f"{cpu_server.url}/v2/cudasharedmemory/region/r/status", timeout=10)
        assert r.status_code == 404 and "Unable to find cuda shared memory region: 'r'" in r.json()["error"]
        with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory region: 'r'"):
            grpc_.get_cuda_shared_memory_status("r")
    finally:
        http.close()
        grpc_.close()


def test_gpu_repository_builder_reports_what_it_skipped(tmp_path):
    built = gm.build_gpu_repository(tmp_path / "repo")
    assert built["mlp_cpu"] == ""
    assert set(built) == {"mlp_cpu", "mlp_gpu", "mlp_trt_ep", "mlp_plan", "add_pt_gpu"}
    for name, reason in built.items():
        assert (tmp_path / "repo" / name / "config.pbtxt").exists() == (reason == ""), (name, reason)
        if reason:
            assert "\n" not in reason
        else:
            parse_text((tmp_path / "repo" / name / "config.pbtxt").read_text())
    if GPU_REASON is not None:
        assert all(built[n] == GPU_REASON for n in ("mlp_gpu", "mlp_trt_ep", "mlp_plan", "add_pt_gpu"))


# =====================================================================================================
# GPU tier (pytest -m gpu)
# =====================================================================================================


@pytest.fixture(scope="module")
def gpu_repo(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "models"
    return out, gm.build_gpu_repository(out)


def _serving(gpu_repo, *args: str):
    """`naiad serve` over the GPU repository while a fixture lasts; returns the server's exit status."""
    repo, _ = gpu_repo
    proc = NaiadProcess(repo, "--strict-readiness", "false", *args, timeout=300)
    proc.start()
    yield proc
    return proc.stop(), proc


@pytest.fixture(scope="module")
def gpu_server(gpu_repo):
    yield from _serving(gpu_repo, "--log-verbose", "1")


def _ready(server, built: dict, name: str) -> None:
    """Skip (one line) when the model could not be built here; fail with the server's reason if it did not
    load."""
    if built[name]:
        pytest.skip(built[name])
    state, reason = _reasons(server).get(name, (None, "not in the repository index"))
    assert state == "READY", f"model '{name}' is {state}: {reason}\n{server.output()[-4000:]}"


def _infer(client_mod, addr, model, x, output="output", input_name="input"):
    client = client_mod.InferenceServerClient(addr)
    try:
        inp = client_mod.InferInput(input_name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return client.infer(model, [inp], outputs=[client_mod.InferRequestedOutput(output)]).as_numpy(output)
    finally:
        client.close()


@gpu_test
def test_gpu_is_visible_to_the_server(gpu_server):
    meta = requests.get(f"{gpu_server.url}/v2", timeout=10).json()
    reason = cuda_runtime.cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    assert "cuda_shared_memory" in meta["extensions"]
    assert gpu.device_count() >= 1 and gpu.devices()[0]["uuid"].startswith(("GPU-", "MIG-"))


@gpu_test
def test_onnx_cuda_ep_matches_cpu(gpu_server, gpu_repo):
    _, built = gpu_repo
    _ready(gpu_server, built, "mlp_gpu")
    config = requests.get(f"{gpu_server.url}/v2/models/mlp_gpu/config", timeout=10).json()
    assert config["instance_group"][0]["kind"] == "KIND_GPU"
    x = np.random.default_rng(3).standard_normal((8, 16)).astype(np.float32)
    for mod, addr in ((httpclient, gpu_server.http), (grpcclient, gpu_server.grpc)):
        on_gpu = _infer(mod, addr, "mlp_gpu", x)
        on_cpu = _infer(mod, addr, "mlp_cpu", x)
        np.testing.assert_allclose(on_gpu, on_cpu, rtol=1e-4, atol=1e-4)


@gpu_test
def test_onnx_tensorrt_ep_fp16_loads(gpu_server, gpu_repo):
    _, built = gpu_repo
    _ready(gpu_server, built, "mlp_trt_ep")
    x = np.random.default_rng(4).standard_normal((4, 16)).astype(np.float32)
    got = _infer(httpclient, gpu_server.http, "mlp_trt_ep", x)
    np.testing.assert_allclose(got, gm.reference_mlp(x), rtol=2e-2, atol=2e-2)  # FP16 kernels


@gpu_test
def test_tensorrt_plan_serves_close_to_onnxruntime(gpu_server, gpu_repo):
    _, built = gpu_repo
    _ready(gpu_server, built, "mlp_plan")
    config = requests.get(f"{gpu_server.url}/v2/models/mlp_plan/config", timeout=10).json()
    assert config["max_batch_size"] == gm.PLAN_PROFILE[2]  # auto-completed from the profile
    assert [(i["name"], [int(d) for d in i["dims"]]) for i in config["input"]] == [("input", [16])]
    rng = np.random.default_rng(5)
    for batch in (1, 7, 32):
        x = rng.standard_normal((batch, 16)).astype(np.float32)
        for mod, addr in ((httpclient, gpu_server.http), (grpcclient, gpu_server.grpc)):
            np.testing.assert_allclose(
                _infer(mod, addr, "mlp_plan", x), gm.reference_mlp(x), rtol=1e-3, atol=1e-3
            )
    with pytest.raises(InferenceServerException):
        _infer(httpclient, gpu_server.http, "mlp_plan", np.zeros((33, 16), np.float32))


@gpu_test
def test_tensorrt_plan_under_concurrency(gpu_server, gpu_repo):
    """Dynamic batching stacks concurrent requests; two instances each with their own context and stream."""
    from concurrent.futures import ThreadPoolExecutor

    _, built = gpu_repo
    _ready(gpu_server, built, "mlp_plan")
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((int(rng.integers(1, 5)), 16)).astype(np.float32) for _ in range(64)]
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda x: _infer(grpcclient, gpu_server.grpc, "mlp_plan", x), xs))
    for x, y in zip(xs, outs):
        np.testing.assert_allclose(y, gm.reference_mlp(x), rtol=1e-3, atol=1e-3)


def _cuda_shm_roundtrip(server, model, proto, make_region, read_region):
    mod, addr = (httpclient, server.http) if proto == "http" else (grpcclient, server.grpc)
    client = mod.InferenceServerClient(addr)
    x = np.random.default_rng(7).standard_normal((5, 16)).astype(np.float32)
    expected = gm.reference_mlp(x)
    in_region, in_b64 = make_region(f"in_{proto}", x.nbytes, x)
    out_region, out_b64 = make_region(f"out_{proto}", expected.nbytes, None)
    try:
        client.register_cuda_shared_memory(f"in_{proto}", in_b64, 0, x.nbytes)
        client.register_cuda_shared_memory(f"out_{proto}", out_b64, 0, expected.nbytes)
        status = client.get_cuda_shared_memory_status()
        names = {r["name"] for r in status} if proto == "http" else set(status.regions)
        assert {f"in_{proto}", f"out_{proto}"} <= names
        inp = mod.InferInput("input", [5, 16], "FP32")
        inp.set_shared_memory(f"in_{proto}", x.nbytes)
        out = mod.InferRequestedOutput("output")
        out.set_shared_memory(f"out_{proto}", expected.nbytes)
        client.infer(model, [inp], outputs=[out])
        np.testing.assert_allclose(read_region(out_region, expected), expected, rtol=1e-3, atol=1e-3)
    finally:
        client.unregister_cuda_shared_memory(f"in_{proto}")
        client.unregister_cuda_shared_memory(f"out_{proto}")
        status = client.get_cuda_shared_memory_status()
        names = {r["name"] for r in status} if proto == "http" else set(status.regions)
        assert not names & {f"in_{proto}", f"out_{proto}"}
        client.close()
    return in_region, out_region


@pytest.fixture(scope="module")
def gpu_workers_server(gpu_repo):
    """The GPU repository behind `--frontend-workers 2`: the engine opens CUDA IPC handles for every worker."""
    code, proc = yield from _serving(gpu_repo, "--frontend-workers", "2")
    assert code == 0, proc.output()[-4000:]


@gpu_test
@pytest.mark.parametrize("workers", [False, True], ids=["one-process", "frontend-workers"])
@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_cuda_shared_memory_roundtrip_tritonclient(request, gpu_repo, proto, workers):
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except Exception as exc:
        pytest.skip(f"tritonclient.utils.cuda_shared_memory does not import: {exc}".splitlines()[0])
    gpu_server = request.getfixturevalue("gpu_workers_server" if workers else "gpu_server")
    _, built = gpu_repo
    model = "mlp_gpu" if not built["mlp_gpu"] else "mlp_cpu"
    _ready(gpu_server, built, model)
    assert "cuda_shared_memory" in requests.get(f"http://{gpu_server.http}/v2").json()["extensions"]
    handles = []

    def make(name, size, data):
        h = cudashm.create_shared_memory_region(name, size, 0)
        handles.append(h)
        if data is not None:
            cudashm.set_shared_memory_region(h, [data])
        return h, cudashm.get_raw_handle(h)

    try:
        _cuda_shm_roundtrip(
            gpu_server,
            model,
            proto,
            make,
            lambda h, like: cudashm.get_contents_as_numpy(h, np.float32, list(like.shape)),
        )
    finally:
        for h in handles:
            cudashm.destroy_shared_memory_region(h)


@gpu_test
@pytest.mark.parametrize("model", ["mlp_gpu", "mlp_plan"])
def test_cuda_shared_memory_roundtrip_cuda_python(gpu_server, gpu_repo, model):
    reason = cuda_runtime.cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    _, built = gpu_repo
    _ready(gpu_server, built, model)
    regions = []

    def make(name, size, data):
        r = gm.DeviceRegion(size)
        regions.append(r)
        if data is not None:
            r.write(data)
        return r, r.b64

    try:
        for proto in ("http", "grpc"):
            _cuda_shm_roundtrip(
                gpu_server, model, proto, make, lambda r, like: r.read(like.dtype, like.shape)
            )
    finally:
        for r in regions:
            r.free()


@gpu_test
def test_gpu_metrics_have_uuid_labels(gpu_server):
    reason = gm.nvml_reason()
    if reason is not None:
        pytest.skip(reason)
    text = requests.get(f"http://{gpu_server.metrics}/metrics", timeout=10).text
    for family in ("nv_gpu_utilization", "nv_gpu_memory_total_bytes"):
        lines = [line for line in text.splitlines() if line.startswith(family + "{")]
        assert lines, f"{family} missing from /metrics"
        assert all('gpu_uuid="GPU-' in line or 'gpu_uuid="MIG-' in line for line in lines), lines
    total = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("nv_gpu_memory_total_bytes{")
    ]
    assert all(v > 0 for v in total)


@gpu_test
def test_torchscript_on_kind_gpu(gpu_server, gpu_repo):
    _, built = gpu_repo
    _ready(gpu_server, built, "add_pt_gpu")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 2.0, dtype=np.float32)
    for mod, addr in ((httpclient, gpu_server.http), (grpcclient, gpu_server.grpc)):
        client = mod.InferenceServerClient(addr)
        try:
            inputs = [mod.InferInput("INPUT__0", [2, 3], "FP32"), mod.InferInput("INPUT__1", [2, 3], "FP32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = client.infer("add_pt_gpu", inputs)
            np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), a + b)
            np.testing.assert_allclose(result.as_numpy("OUTPUT__1"), a * b)
        finally:
            client.close()


@gpu_test
def test_host_register_page_locks_a_receive_buffer():
    """The real cudaHostRegister on a pooled receive buffer: the CUDA runtime then reports it as page-locked
    host memory, and no longer once it is unpinned."""
    import mmap

    from naiad import host_pinning, memory

    rt = cuda_runtime.cudart()
    pools = memory.MemoryPools(pinned_bytes=8 << 20)
    pinning = host_pinning.HostPinning(rt, pools)
    buf = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE)
    addr, _ = host_pinning.address_of(buf)

    def memory_type():
        return cuda_runtime.check(rt.cudaPointerGetAttributes(addr), "cudaPointerGetAttributes").type

    assert memory_type() == rt.cudaMemoryType.cudaMemoryTypeUnregistered
    assert pinning.pin(buf) and pools.pinned_used == 4 << 20
    assert memory_type() == rt.cudaMemoryType.cudaMemoryTypeHost
    pinning.unpin(buf)
    assert memory_type() == rt.cudaMemoryType.cudaMemoryTypeUnregistered and pools.pinned_used == 0


@gpu_test
def test_large_requests_to_a_gpu_model_arrive_in_page_locked_buffers(gpu_server, gpu_repo):
    """A GPU server page-locks the buffers large requests are read into (their copy to the device is DMA), and
    the model still gets the right bytes over HTTP binary and gRPC."""
    _, built = gpu_repo
    _ready(gpu_server, built, "add_pt_gpu")
    a = np.arange(1 << 18, dtype=np.float32).reshape(1, -1)  # 1 MiB per input: a pooled receive buffer
    b = np.full_like(a, 0.5)
    for mod, addr in ((httpclient, gpu_server.http), (grpcclient, gpu_server.grpc)):
        client = mod.InferenceServerClient(addr)
        try:
            inputs = [
                mod.InferInput("INPUT__0", list(a.shape), "FP32"),
                mod.InferInput("INPUT__1", list(b.shape), "FP32"),
            ]
            for inp, x in zip(inputs, (a, b)):
                inp.set_data_from_numpy(x, **({"binary_data": True} if mod is httpclient else {}))
            result = client.infer("add_pt_gpu", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), a + b)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), a * b)
        finally:
            client.close()
    assert "page-locked a request buffer" in gpu_server.output()
