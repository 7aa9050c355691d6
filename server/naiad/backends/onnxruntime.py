"""ONNX Runtime backend: one InferenceSession per instance; config auto-completed from the model as Triton does."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..config import ModelConfig
from ..errors import InvalidArgument, Unavailable
from .api import InstanceState, ModelFileBackend, ModelState

# ORT type strings -> config enum
_ORT_TYPES = {
    "tensor(float)": mc.TYPE_FP32,
    "tensor(double)": mc.TYPE_FP64,
    "tensor(float16)": mc.TYPE_FP16,
    "tensor(bfloat16)": mc.TYPE_BF16,
    "tensor(int8)": mc.TYPE_INT8,
    "tensor(int16)": mc.TYPE_INT16,
    "tensor(int32)": mc.TYPE_INT32,
    "tensor(int64)": mc.TYPE_INT64,
    "tensor(uint8)": mc.TYPE_UINT8,
    "tensor(uint16)": mc.TYPE_UINT16,
    "tensor(uint32)": mc.TYPE_UINT32,
    "tensor(uint64)": mc.TYPE_UINT64,
    "tensor(bool)": mc.TYPE_BOOL,
    "tensor(string)": mc.TYPE_STRING,
}
# Triton's onnxruntime backend default for models whose first dimension is dynamic everywhere.
DEFAULT_MAX_BATCH_SIZE = 4


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise Unavailable(
            "the onnxruntime backend needs the 'onnxruntime' package: pip install 'naiad[onnx]'"
        ) from None
    return onnxruntime


def _dims(shape) -> list[int]:
    return [d if isinstance(d, int) and d > 0 else -1 for d in shape]


def auto_complete(config: ModelConfig, model_file: Path) -> None:
    """Fill missing inputs, outputs and max_batch_size from the ONNX graph (Triton's rules)."""
    ort = _ort()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        sess = ort.InferenceSession(str(model_file), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise InvalidArgument(f"failed to load ONNX model {model_file}: {exc}") from None
    ins, outs = sess.get_inputs(), sess.get_outputs()
    if config.max_batch_size == 0 and not config.input and not config.output:
        batchable = all(
            len(t.shape) >= 1 and not (isinstance(t.shape[0], int) and t.shape[0] > 0)
            for t in list(ins) + list(outs)
        )
        if batchable:
            config.max_batch_size = DEFAULT_MAX_BATCH_SIZE
            if not config.HasField("dynamic_batching") and not config.HasField("sequence_batching"):
                config.dynamic_batching.SetInParent()
    skip = 1 if config.max_batch_size > 0 else 0
    # Sequence-batcher control and state tensors are fed by the server, never declared as model I/O.
    seq = config.sequence_batching
    managed = (
        {c.name for c in seq.control_input}
        | {s.input_name for s in seq.state}
        | {s.output_name for s in seq.state}
    )
    for kind, tensors, declared in (("input", ins, config.input), ("output", outs, config.output)):
        known = {t.name for t in declared} | managed
        for t in tensors:
            if t.name in known:
                continue
            dtype = _ORT_TYPES.get(t.type)
            if dtype is None:
                raise InvalidArgument(f"ONNX {kind} '{t.name}' has unsupported type {t.type}")
            entry = declared.add()
            entry.name = t.name
            entry.data_type = dtype
            dims = _dims(t.shape)[skip:]
            entry.dims.extend(dims if dims or skip else [1])


class _Session:
    """An instance's engine: the InferenceSession and which of its tensors are strings."""

    def __init__(self, session, run_options):
        self.session = session
        self.string_inputs = {i.name for i in session.get_inputs() if i.type == "tensor(string)"}
        self.string_outputs = {o.name for o in session.get_outputs() if o.type == "tensor(string)"}
        self.run_options = run_options


class OnnxBackend(ModelFileBackend):
    """One InferenceSession per instance, through the same lifecycle API every plug-in uses."""

    name = "onnxruntime"
    default_model_filename = "model.onnx"
    allow_inline = True  # a small graph runs on the event loop once it has proved fast (base.InlinePolicy)

    auto_complete = staticmethod(auto_complete)

    def instance_initialize(self, instance: InstanceState) -> None:
        ort = _ort()
        model = instance.model
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        params = model.parameters
        intra = int(params.get("intra_op_thread_count", "0") or 0)
        if intra <= 0:
            # Share the cores among the instances instead of letting each grab them all.
            total = sum(g.count for g in model.config.instance_group) or 1
            intra = max(1, (os.cpu_count() or 1) // total)
        opts.intra_op_num_threads = intra
        inter = int(params.get("inter_op_thread_count", "0") or 0)
        if inter > 0:
            opts.inter_op_num_threads = inter
        level = model.config.optimization.graph.level
        if level == -1:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        elif level == 1:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        providers = self._providers(ort, model, instance)
        try:
            session = ort.InferenceSession(str(model.model_file), opts, providers=providers)
        except Exception as exc:
            raise InvalidArgument(f"failed to load ONNX model {model.model_file}: {exc}") from None
        instance.state = _Session(session, ort.RunOptions())

    @staticmethod
    def _providers(ort, model: ModelState, instance: InstanceState) -> list:
        if instance.kind != "GPU":
            return ["CPUExecutionProvider"]
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise Unavailable(
                f"model '{model.name}' asks for a GPU instance but onnxruntime has no CUDA execution provider "
                "(install 'naiad[gpu]')"
            )
        device_id = instance.device_id
        providers: list = []
        for acc in model.config.optimization.execution_accelerators.gpu_execution_accelerator:
            if acc.name == "tensorrt" and "TensorrtExecutionProvider" in available:
                trt = {"device_id": device_id}
                p = dict(acc.parameters)
                if p.get("precision_mode", "").upper() == "FP16":
                    trt["trt_fp16_enable"] = True
                if "max_workspace_size_bytes" in p:
                    trt["trt_max_workspace_size"] = int(p["max_workspace_size_bytes"])
                cache = p.get("trt_engine_cache_path")
                if cache or p.get("trt_engine_cache_enable", "").lower() == "true":
                    trt["trt_engine_cache_enable"] = True
                    trt["trt_engine_cache_path"] = cache or str(model.version_path / "trt_cache")
                providers.append(("TensorrtExecutionProvider", trt))
        providers.append(("CUDAExecutionProvider", {"device_id": device_id}))
        providers.append("CPUExecutionProvider")
        return providers

    def instance_execute(self, instance: InstanceState, requests):
        batch = instance.gather(requests)
        engine: _Session = instance.state
        feed = {}
        for name, arr in batch.inputs.items():
            if name in engine.string_inputs:
                arr = np.vectorize(
                    lambda b: b.decode("utf-8", "replace") if isinstance(b, bytes) else b, otypes=[object]
                )(arr)
            feed[name] = arr
        try:
            results = engine.session.run(batch.outputs, feed, engine.run_options)
        except Exception as exc:
            raise InvalidArgument(f"onnxruntime execute failure: {exc}") from None
        out = {}
        for name, arr in zip(batch.outputs, results):
            if name in engine.string_outputs:
                arr = np.vectorize(lambda s: s.encode("utf-8") if isinstance(s, str) else s, otypes=[object])(
                    arr
                )
            out[name] = arr
        return instance.scatter(requests, batch, out)


# Registered under the entry-point group naiad.backends (pyproject.toml).
backend = OnnxBackend()
