"""TensorRT backend: a serialized engine (`model.plan`, TensorRT >= 10) per instance on its GPU.

Each instance deserializes the plan on its device (`instance_group.gpus`) and owns one execution context and
one non-blocking CUDA stream. I/O bindings come from the engine's named I/O tensors. For each execution the
input shapes pick an optimisation profile that admits them (the current one first); inputs are staged through
page-locked host buffers and device buffers that are kept between requests and grown when a larger shape
arrives; outputs are copied device->host once, after which the stream is synchronised once.

Not supported (clear errors): KIND_CPU instances, shape tensors / host-resident I/O, and outputs whose shape
depends on the data (they would need an IOutputAllocator).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .. import cuda_runtime, gpu, memory
from ..config import ModelConfig, data_type_name
from ..errors import Internal, InvalidArgument, Unavailable, Unsupported
from .api import ModuleBackend
from .base import ModelContext, TensorInstance

log = logging.getLogger("naiad.tensorrt")

# TensorRT DataType name -> (config enum, numpy dtype). BF16 travels as uint16 words, as in naiad.tensors.
_TRT_TYPES = {
    "FLOAT": (mc.TYPE_FP32, np.dtype(np.float32)),
    "HALF": (mc.TYPE_FP16, np.dtype(np.float16)),
    "BF16": (mc.TYPE_BF16, np.dtype(np.uint16)),
    "INT8": (mc.TYPE_INT8, np.dtype(np.int8)),
    "UINT8": (mc.TYPE_UINT8, np.dtype(np.uint8)),
    "INT32": (mc.TYPE_INT32, np.dtype(np.int32)),
    "INT64": (mc.TYPE_INT64, np.dtype(np.int64)),
    "BOOL": (mc.TYPE_BOOL, np.dtype(np.bool_)),
}
_MIN_ALLOC = 256


def _trt():
    try:
        import tensorrt
    except ImportError:
        raise Unavailable(
            "the tensorrt backend needs the 'tensorrt' package (TensorRT >= 10): "
            "pip install 'naiad[tensorrt]'"
        ) from None
    return tensorrt


_loggers: dict = {}


def _trt_logger(trt):
    """One ILogger per tensorrt module that forwards TensorRT's messages to Python logging."""
    logger = _loggers.get(trt)
    if logger is None:
        levels = {}
        for name, level in (
            ("INTERNAL_ERROR", logging.CRITICAL),
            ("ERROR", logging.ERROR),
            ("WARNING", logging.WARNING),
            ("INFO", logging.DEBUG),
            ("VERBOSE", logging.DEBUG),
        ):
            sev = getattr(trt.ILogger.Severity, name, None)
            if sev is not None:
                levels[sev] = level

        class _Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)

            def log(self, severity, msg):
                log.log(levels.get(severity, logging.INFO), "%s", msg)

        logger = _loggers[trt] = _Logger()
    return logger


def _need_gpu(what: str) -> None:
    """Check the CUDA side before touching TensorRT's runtime: cuda-python importable, a device present."""
    cuda_runtime.cudart()
    if gpu.device_count() == 0:
        raise Unavailable(f"{what}: the tensorrt backend needs a CUDA GPU and none is available")


def _load_engine(trt, path: Path, device_id: int):
    cuda_runtime.set_device(device_id)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"failed to read TensorRT plan {path}: {exc}") from None
    runtime = trt.Runtime(_trt_logger(trt))
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:
        raise InvalidArgument(
            f"failed to deserialize TensorRT plan {path} on GPU {device_id}: a plan only loads with the "
            f"TensorRT version and GPU architecture it was built for (this is TensorRT {trt.__version__})"
        )
    return runtime, engine


@dataclass
class _Tensor:
    name: str
    is_input: bool
    config_type: int
    dtype: np.dtype
    shape: list[int]  # engine shape, -1 where dynamic
    # inputs only: (min, opt, max) shape per optimisation profile
    profiles: list[tuple[list[int], list[int], list[int]]] = field(default_factory=list)


def _describe(trt, engine, model: str) -> list[_Tensor]:
    out = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        trt_type = engine.get_tensor_dtype(name)
        type_name = getattr(trt_type, "name", str(trt_type).rsplit(".", 1)[-1])
        if type_name not in _TRT_TYPES:
            raise InvalidArgument(
                f"model '{model}': TensorRT tensor '{name}' has type {type_name}, which Naiad cannot "
                f"exchange (supported: {', '.join(sorted(_TRT_TYPES))})"
            )
        if engine.is_shape_inference_io(name):
            raise InvalidArgument(
                f"model '{model}': TensorRT tensor '{name}' is a shape tensor; engines "
                "with shape tensors are not supported"
            )
        if engine.get_tensor_location(name) != trt.TensorLocation.DEVICE:
            raise InvalidArgument(
                f"model '{model}': TensorRT tensor '{name}' lives in host memory; only "
                "device-resident I/O is supported"
            )
        config_type, dtype = _TRT_TYPES[type_name]
        t = _Tensor(name, is_input, config_type, dtype, [int(d) for d in engine.get_tensor_shape(name)])
        if is_input:
            for p in range(engine.num_optimization_profiles):
                if -1 in t.shape:
                    lo, opt, hi = engine.get_tensor_profile_shape(name, p)
                    t.profiles.append(([int(d) for d in lo], [int(d) for d in opt], [int(d) for d in hi]))
                else:
                    t.profiles.append((t.shape, t.shape, t.shape))
        out.append(t)
    return out


def _engine_max_batch(ios: list[_Tensor]) -> int:
    """The largest batch some profile admits for every input (0 when the first dims are not all dynamic)."""
    if not ios or not all(len(t.shape) >= 1 and t.shape[0] == -1 for t in ios):
        return 0
    inputs = [t for t in ios if t.is_input]
    if not inputs:
        return 0
    nprof = len(inputs[0].profiles)
    return max((min(t.profiles[p][2][0] for t in inputs) for p in range(nprof)), default=0)


def auto_complete(config: ModelConfig, model_file: Path) -> None:
    """Fill missing inputs, outputs and max_batch_size from the engine's I/O tensors.

    When every I/O tensor's first dimension is dynamic and the config names no tensors and no max_batch_size,
    the model batches: max_batch_size becomes the largest first dimension an optimisation profile allows."""
    trt = _trt()
    _need_gpu(f"model '{config.name}'")
    device = next((g for group in config.instance_group for g in group.gpus), 0)
    runtime, engine = _load_engine(trt, model_file, device)
    try:
        ios = _describe(trt, engine, config.name)
    finally:
        del engine, runtime
    if config.max_batch_size == 0 and not config.input and not config.output:
        mbs = _engine_max_batch(ios)
        if mbs > 0:
            config.max_batch_size = mbs
            if not config.HasField("dynamic_batching") and not config.HasField("sequence_batching"):
                config.dynamic_batching.SetInParent()
    skip = 1 if config.max_batch_size > 0 else 0
    for is_input, declared in ((True, config.input), (False, config.output)):
        known = {t.name for t in declared}
        for t in ios:
            if t.is_input != is_input or t.name in known:
                continue
            entry = declared.add()
            entry.name = t.name
            entry.data_type = t.config_type
            dims = t.shape[skip:]
            entry.dims.extend(dims if dims or skip else [1])


class TensorRTInstance(TensorInstance):
    def __init__(self, ctx: ModelContext, group, device_id: int, index: int):
        super().__init__(ctx, group, device_id, index)
        self._closed = True
        trt = _trt()
        if group.kind != mc.ModelInstanceGroup.KIND_GPU:
            raise InvalidArgument(
                f"model '{ctx.name}': instance group '{group.name}' is "
                f"{mc.ModelInstanceGroup.Kind.Name(group.kind)}, but the tensorrt backend only runs on GPU "
                "instances (KIND_GPU)"
            )
        _need_gpu(f"model '{ctx.name}'")
        self.rt = cuda_runtime.cudart()
        self.trt = trt
        self._device_buffers: dict[str, tuple[int, int]] = {}  # name -> (pointer, capacity)
        # name -> (pointer, capacity, view, page-locked?): staging buffers are drawn from the pinned memory pool
        # (--pinned-memory-pool-byte-size) and fall back to pageable memory when it is exhausted, as Triton's.
        self._host_buffers: dict[str, tuple[int, int, np.ndarray, bool]] = {}
        self.stream = None
        self.context = None
        self.runtime, self.engine = _load_engine(trt, ctx.model_file, device_id)
        self._closed = False
        try:
            ios = _describe(trt, self.engine, ctx.name)
            self.inputs = {t.name: t for t in ios if t.is_input}
            self.outputs = {t.name: t for t in ios if not t.is_input}
            self._validate(ctx)
            self.context = self.engine.create_execution_context()
            if self.context is None:
                raise Internal(
                    f"model '{ctx.name}': TensorRT could not create an execution context on GPU "
                    f"{device_id} (out of device memory?)"
                )
            self.stream = cuda_runtime.check(
                self.rt.cudaStreamCreateWithFlags(self.rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"
            )
            self.stream_handle = int(self.stream)
            self.profile = 0
            self.nprofiles = self.engine.num_optimization_profiles
        except BaseException:
            self.close()
            raise

    def _validate(self, ctx: ModelContext) -> None:
        config = ctx.config
        for kind, declared, engine_side in (
            ("input", config.input, self.inputs),
            ("output", config.output, self.outputs),
        ):
            for t in declared:
                e = engine_side.get(t.name)
                if e is None:
                    raise InvalidArgument(
                        f"model '{ctx.name}': {kind} '{t.name}' is not an {kind} of the TensorRT engine "
                        f"(engine {kind}s: {', '.join(engine_side) or 'none'})"
                    )
                if t.data_type != e.config_type:
                    raise InvalidArgument(
                        f"model '{ctx.name}': {kind} '{t.name}' is {data_type_name(t.data_type)} in the "
                        f"config but {data_type_name(e.config_type)} in the TensorRT engine"
                    )
        missing = [n for n in self.inputs if n not in {t.name for t in config.input}]
        if missing:
            raise InvalidArgument(
                f"model '{ctx.name}': the TensorRT engine's inputs {missing} are not declared in the config"
            )
        if config.max_batch_size > 0:
            fixed = [
                t.name
                for t in (*self.inputs.values(), *self.outputs.values())
                if not t.shape or t.shape[0] != -1
            ]
            if fixed:
                raise InvalidArgument(
                    f"model '{ctx.name}': max_batch_size is {config.max_batch_size} but the TensorRT "
                    f"engine's tensors {fixed} have no dynamic first (batch) dimension"
                )
            limit = _engine_max_batch([*self.inputs.values(), *self.outputs.values()])
            if config.max_batch_size > limit:
                raise InvalidArgument(
                    f"model '{ctx.name}': max_batch_size {config.max_batch_size} exceeds the largest batch "
                    f"the TensorRT engine's optimisation profiles allow ({limit})"
                )

    # ---- buffers ----
    @staticmethod
    def _capacity(nbytes: int) -> int:
        return max(_MIN_ALLOC, 1 << max(0, nbytes - 1).bit_length())

    def _device(self, name: str, nbytes: int) -> int:
        ptr, cap = self._device_buffers.get(name, (0, 0))
        if nbytes > cap or not ptr:
            if ptr:
                cuda_runtime.check(self.rt.cudaFree(ptr), "cudaFree")
                del self._device_buffers[name]
            cap = self._capacity(nbytes)
            ptr = int(cuda_runtime.check(self.rt.cudaMalloc(cap), f"cudaMalloc({cap})"))
            self._device_buffers[name] = (ptr, cap)
        return ptr

    def _host(self, name: str, nbytes: int) -> tuple[int, np.ndarray]:
        ptr, cap, view, pinned = self._host_buffers.get(name, (0, 0, None, False))
        if nbytes > cap or not ptr:
            if ptr:
                self._free_host(ptr, cap, pinned)
                del self._host_buffers[name]
            cap = self._capacity(nbytes)
            pinned = memory.pools.reserve_pinned(cap)
            if pinned:
                ptr = int(cuda_runtime.check(self.rt.cudaMallocHost(cap), f"cudaMallocHost({cap})"))
                view = np.ctypeslib.as_array((ctypes.c_uint8 * cap).from_address(ptr))
            else:
                view = np.empty(cap, np.uint8)
                ptr = view.ctypes.data
            self._host_buffers[name] = (ptr, cap, view, pinned)
        return ptr, view

    def _free_host(self, ptr: int, cap: int, pinned: bool) -> None:
        if pinned:
            cuda_runtime.check(self.rt.cudaFreeHost(ptr), "cudaFreeHost")
            memory.pools.release_pinned(cap)

    # ---- execution ----
    def _select_profile(self, shapes: dict[str, tuple[int, ...]]) -> int:
        def fits(p: int) -> bool:
            for name, shape in shapes.items():
                lo, _, hi = self.inputs[name].profiles[p]
                if len(shape) != len(lo) or any(d < a or d > b for d, a, b in zip(shape, lo, hi)):
                    return False
            return True

        for p in [self.profile] + [p for p in range(self.nprofiles) if p != self.profile]:
            if fits(p):
                return p
        ranges = "; ".join(
            f"profile {p}: "
            + ", ".join(f"{n} {t.profiles[p][0]}..{t.profiles[p][2]}" for n, t in self.inputs.items())
            for p in range(self.nprofiles)
        )
        got = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
        raise InvalidArgument(
            f"model '{self.ctx.name}': input shapes ({got}) fit none of the TensorRT "
            f"engine's optimisation profiles ({ranges})"
        )

    def warmup_thread_init(self) -> None:
        cuda_runtime.set_device(self.device_id)

    def run(self, inputs, outputs):
        if self._closed:
            raise Unavailable(f"model '{self.ctx.name}' instance {self.name} is closed")
        rt, context = self.rt, self.context
        cuda_runtime.set_device(self.device_id)
        arrays = {}
        for name in self.inputs:
            arr = inputs.get(name)
            if arr is None:
                raise InvalidArgument(f"model '{self.ctx.name}': input '{name}' is missing")
            arrays[name] = np.asarray(arr)
        shapes = {name: tuple(int(d) for d in a.shape) for name, a in arrays.items()}
        profile = self._select_profile(shapes)
        if profile != self.profile:
            if not context.set_optimization_profile_async(profile, self.stream_handle):
                raise Internal(f"model '{self.ctx.name}': TensorRT refused optimisation profile {profile}")
            self.profile = profile
        h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        for name, arr in arrays.items():
            if not context.set_input_shape(name, shapes[name]):
                raise InvalidArgument(
                    f"model '{self.ctx.name}': TensorRT rejected shape "
                    f"{list(shapes[name])} for input '{name}'"
                )
            dtype = self.inputs[name].dtype
            nbytes = arr.size * dtype.itemsize
            dptr = self._device(name, nbytes)
            if nbytes:
                hptr, view = self._host(name, nbytes)
                # one copy (and cast, if the client sent another type) into the pinned staging buffer
                np.copyto(view[:nbytes].view(dtype).reshape(arr.shape), arr, casting="same_kind")
                cuda_runtime.check(
                    rt.cudaMemcpyAsync(dptr, hptr, nbytes, h2d, self.stream), "cudaMemcpyAsync (input)"
                )
            context.set_tensor_address(name, dptr)
        out_shapes = {}
        for name, t in self.outputs.items():
            shape = tuple(int(d) for d in context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise Unsupported(
                    f"model '{self.ctx.name}': output '{name}' has a data-dependent shape "
                    f"{list(shape)}, which the tensorrt backend does not support"
                )
            out_shapes[name] = shape
            nbytes = int(np.prod(shape, dtype=np.int64)) * t.dtype.itemsize
            context.set_tensor_address(name, self._device(name, nbytes))
        if not context.execute_async_v3(self.stream_handle):
            cuda_runtime.check(rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
            raise Internal(f"model '{self.ctx.name}': TensorRT execution failed (see the server log)")
        d2h = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        staged = {}
        for name in outputs:
            t = self.outputs.get(name)
            if t is None:
                raise InvalidArgument(f"model '{self.ctx.name}': unknown output '{name}'")
            count = int(np.prod(out_shapes[name], dtype=np.int64))
            nbytes = count * t.dtype.itemsize
            if nbytes:
                hptr, view = self._host(name, nbytes)
                dptr = self._device_buffers[name][0]
                cuda_runtime.check(
                    rt.cudaMemcpyAsync(hptr, dptr, nbytes, d2h, self.stream), "cudaMemcpyAsync (output)"
                )
                staged[name] = (view, count, t.dtype)
            else:
                staged[name] = (None, 0, t.dtype)
        cuda_runtime.check(rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        results = {}
        for name, (view, count, dtype) in staged.items():
            if view is None:
                results[name] = np.empty(out_shapes[name], dtype=dtype)
            else:
                # The pinned buffer is reused by the next execution: the response gets its own array.
                results[name] = view[: count * dtype.itemsize].view(dtype).reshape(out_shapes[name]).copy()
        return results

    def close(self):
        if getattr(self, "_closed", True) and getattr(self, "engine", None) is None:
            return
        self._closed = True
        try:
            cuda_runtime.set_device(self.device_id)
            if self.stream is not None:
                self.rt.cudaStreamSynchronize(self.stream)
            for ptr, _ in self._device_buffers.values():
                self.rt.cudaFree(ptr)
            for ptr, cap, _, pinned in self._host_buffers.values():
                if pinned:
                    self.rt.cudaFreeHost(ptr)
                    memory.pools.release_pinned(cap)
            if self.stream is not None:
                self.rt.cudaStreamDestroy(self.stream)
        except Exception as exc:
            log.warning("releasing TensorRT instance %s of '%s': %s", self.name, self.ctx.name, exc)
        self._device_buffers, self._host_buffers = {}, {}
        self.stream = None
        self.context = None
        self.engine = None
        self.runtime = None


def create_instance(ctx: ModelContext, group, device_id: int, index: int) -> TensorRTInstance:
    return TensorRTInstance(ctx, group, device_id, index)


# Registered under the entry-point group naiad.backends (pyproject.toml).
backend = ModuleBackend("tensorrt", auto_complete, create_instance, "model.plan")
