"""Builds the GPU test repository, and what the GPU tests need around it.

`build_gpu_repository(out)` writes every model whose prerequisites this machine has and returns, for each
model name, "" when it was built or a one-line reason why not. Models:

  mlp_cpu      ONNX MLP (16 -> 8) on KIND_CPU: the reference outputs
  mlp_gpu      the same ONNX on KIND_GPU (onnxruntime-gpu, CUDA execution provider)
  mlp_trt_ep   the same ONNX on KIND_GPU with the TensorRT execution provider, precision_mode FP16
  mlp_plan     a TensorRT plan built here from the same ONNX (dynamic batch profile 1..32), its config
               auto-completed
  add_pt_gpu   a TorchScript a+b / a*b model on KIND_GPU

`DeviceRegion` is a client-side CUDA IPC region made with cuda-python directly (the server maps it from
another process), independent of tritonclient.utils.cuda_shared_memory.
"""

from __future__ import annotations

import base64
import ctypes
from pathlib import Path

import numpy as np
from build_models import AddMul, export_onnx, mlp

FEATURES, CLASSES = 16, 8
PLAN_PROFILE = (1, 8, 32)  # min, opt, max batch

MLP_CONFIG = """
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [ {{ name: "input" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 8 ] }} ]
instance_group [ {{ kind: {kind} count: 1 }} ]
dynamic_batching {{ }}
{extra}
"""

TRT_EP_FP16 = """
optimization { execution_accelerators { gpu_execution_accelerator : [ {
  name : "tensorrt"
  parameters { key: "precision_mode" value: "FP16" }
  parameters { key: "max_workspace_size_bytes" value: "1073741824" }
} ] } }
"""

# No tensors and no max_batch_size: the tensorrt backend auto-completes them from the engine.
PLAN_CONFIG = """
name: "mlp_plan"
platform: "tensorrt_plan"
instance_group [ { kind: KIND_GPU count: 2 } ]
"""

ADD_PT_GPU_CONFIG = """
name: "add_pt_gpu"
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  { name: "INPUT__0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "INPUT__1" data_type: TYPE_FP32 dims: [ -1 ] }
]
output [
  { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ -1 ] }
]
instance_group [ { kind: KIND_GPU count: 1 } ]
"""


# ---- what this machine has ----


def cuda_device_reason() -> str | None:
    """None when NVML sees a CUDA device, else a one-line reason."""
    from naiad import gpu

    if gpu.device_count() > 0:
        return None
    return "no CUDA device (NVML reports none, or nvidia-ml-py is missing)"


def ort_provider_reason(provider: str) -> str | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    if provider not in ort.get_available_providers():
        return f"onnxruntime has no {provider} (install onnxruntime-gpu: pip install 'naiad[gpu]')"
    return None


def tensorrt_reason() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "tensorrt is not installed (pip install 'naiad[tensorrt]')"
    try:
        from naiad import cuda_runtime

        cuda_runtime.cudart()
    except Exception as exc:
        return str(exc)
    return None


def torch_cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch has no CUDA device (a CPU-only torch build, or no GPU)"
    return None


def torch_gpu_reason() -> str | None:
    """None when NVML sees a CUDA device and torch can use it, else a one-line reason."""
    return cuda_device_reason() or torch_cuda_reason()


def nvml_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception as exc:
        return f"NVML unavailable (pip install nvidia-ml-py): {exc}"
    return None


# ---- models ----


def build_trt_plan(
    onnx_path: Path,
    plan_path: Path,
    profile=PLAN_PROFILE,
    input_name: str = "input",
    features: int = FEATURES,
    workspace: int = 1 << 30,
) -> None:
    """A TensorRT plan from an ONNX file whose input is [batch, features], batch dynamic within `profile`."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network()  # explicit batch is the only mode in TensorRT >= 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(Path(onnx_path).read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    opt = builder.create_optimization_profile()
    lo, mid, hi = profile
    opt.set_shape(input_name, (lo, features), (mid, features), (hi, features))
    config.add_optimization_profile(opt)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build a plan from {onnx_path} (see the log above)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(serialized))


def reference_mlp(x: np.ndarray) -> np.ndarray:
    """The MLP's outputs computed with onnxruntime on CPU from the exported ONNX (built on demand)."""
    import tempfile

    import onnxruntime as ort

    global _REF
    if _REF is None:
        path = Path(tempfile.mkdtemp(prefix="naiad-mlp-")) / "model.onnx"
        export_onnx(mlp(FEATURES, CLASSES), path, FEATURES)
        _REF = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return _REF.run(["output"], {"input": x})[0]


_REF = None


def build_gpu_repository(out: Path) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    built: dict[str, str] = {}
    model = mlp(FEATURES, CLASSES)
    onnx_src = out.parent / (out.name + "_mlp.onnx")
    export_onnx(model, onnx_src, FEATURES)

    def onnx_model(name: str, kind: str, extra: str = "") -> None:
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        (out / name / "1" / "model.onnx").write_bytes(onnx_src.read_bytes())
        (out / name / "config.pbtxt").write_text(MLP_CONFIG.format(name=name, kind=kind, extra=extra))

    onnx_model("mlp_cpu", "KIND_CPU")
    built["mlp_cpu"] = ""
    gpu_reason = cuda_device_reason()
    for name, provider, extra in (
        ("mlp_gpu", "CUDAExecutionProvider", ""),
        ("mlp_trt_ep", "TensorrtExecutionProvider", TRT_EP_FP16),
    ):
        reason = gpu_reason or ort_provider_reason(provider)
        if reason is None:
            onnx_model(name, "KIND_GPU", extra)
        built[name] = reason or ""
    reason = gpu_reason or tensorrt_reason()
    if reason is None:
        try:
            build_trt_plan(onnx_src, out / "mlp_plan" / "1" / "model.plan")
            (out / "mlp_plan" / "config.pbtxt").write_text(PLAN_CONFIG)
        except Exception as exc:
            reason = f"building the TensorRT plan failed: {exc}"
    built["mlp_plan"] = reason or ""
    reason = gpu_reason or torch_cuda_reason()
    if reason is None:
        (out / "add_pt_gpu" / "1").mkdir(parents=True, exist_ok=True)
        AddMul.script().save(str(out / "add_pt_gpu" / "1" / "model.pt"))
        (out / "add_pt_gpu" / "config.pbtxt").write_text(ADD_PT_GPU_CONFIG)
    built["add_pt_gpu"] = reason or ""
    return built


# ---- a client-side CUDA IPC region, with cuda-python only ----


class DeviceRegion:
    """`byte_size` bytes of device memory exported with cudaIpcGetMemHandle, for the server to map."""

    def __init__(self, byte_size: int, device_id: int = 0):
        from naiad import cuda_runtime
        from naiad.shared_memory.cuda import IPC_HANDLE_SIZE

        self.gpu, self.rt = cuda_runtime, cuda_runtime.cudart()
        self.byte_size, self.device_id = byte_size, device_id
        cuda_runtime.set_device(device_id)
        self.ptr = int(cuda_runtime.check(self.rt.cudaMalloc(byte_size), "cudaMalloc"))
        handle = cuda_runtime.check(self.rt.cudaIpcGetMemHandle(self.ptr), "cudaIpcGetMemHandle")
        self.raw = ctypes.string_at(int(handle.getPtr()), IPC_HANDLE_SIZE)

    @property
    def b64(self) -> bytes:
        """What tritonclient's register_cuda_shared_memory takes (HTTP sends it, gRPC decodes it)."""
        return base64.b64encode(self.raw)

    def write(self, array: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(array)
        self.gpu.set_device(self.device_id)
        self.gpu.check(
            self.rt.cudaMemcpy(
                self.ptr + offset,
                data.ctypes.data,
                data.nbytes,
                self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
            ),
            "cudaMemcpy",
        )

    def read(self, dtype, shape, offset: int = 0) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.gpu.set_device(self.device_id)
        self.gpu.check(
            self.rt.cudaMemcpy(
                out.ctypes.data, self.ptr + offset, out.nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
            ),
            "cudaMemcpy",
        )
        return out

    def free(self) -> None:
        if self.ptr:
            self.gpu.set_device(self.device_id)
            self.rt.cudaFree(self.ptr)
            self.ptr = 0
