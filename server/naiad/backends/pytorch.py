"""PyTorch (TorchScript) backend: `model.pt` loaded with torch.jit, inputs bound like Triton's libtorch backend."""

from __future__ import annotations

import os
import re
import threading
import warnings
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..config import ModelConfig, data_type_name
from ..errors import InvalidArgument, Unavailable
from ..tensors import config_to_wire, numpy_dtype
from .api import InstanceState, ModelFileBackend

_INDEXED = re.compile(r"^(.*)__(\d+)$")
_threads_lock = threading.Lock()
_READ_ONLY_NOTE = "The given NumPy array is not writable"

_TORCH_TO_CONFIG = {
    "torch.float32": mc.TYPE_FP32,
    "torch.float64": mc.TYPE_FP64,
    "torch.float16": mc.TYPE_FP16,
    "torch.bfloat16": mc.TYPE_BF16,
    "torch.int8": mc.TYPE_INT8,
    "torch.int16": mc.TYPE_INT16,
    "torch.int32": mc.TYPE_INT32,
    "torch.int64": mc.TYPE_INT64,
    "torch.uint8": mc.TYPE_UINT8,
    "torch.bool": mc.TYPE_BOOL,
}


def _torch():
    try:
        import torch
    except ImportError:
        raise Unavailable(
            "the pytorch backend needs the 'torch' package: pip install 'naiad[torch]'"
        ) from None
    return torch


def _load(path: Path, device: str = "cpu"):
    torch = _torch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            module = torch.jit.load(str(path), map_location=device)
        except Exception as exc:
            raise InvalidArgument(f"failed to load TorchScript model {path}: {exc}") from None
    module.eval()
    return module


def _forward_args(module) -> list[str]:
    schema = module.forward.schema
    return [a.name for a in schema.arguments if a.name != "self"]


def _order(names: list[str], forward_args: list[str]) -> list[str]:
    """Positional order of config tensors: `<name>__<i>` index, else forward-argument names, else config order."""
    indexed = [_INDEXED.match(n) for n in names]
    if names and all(indexed):
        return [n for _, n in sorted((int(m.group(2)), n) for m, n in zip(indexed, names))]
    if names and set(names) <= set(forward_args):
        return sorted(names, key=forward_args.index)
    return list(names)


def auto_complete(config: ModelConfig, model_file: Path) -> None:
    """Beyond Triton: outputs are derived by a probe run once the inputs are declared."""
    if config.input and config.output:
        return
    module = _load(model_file)
    args = _forward_args(module)
    if not config.input:
        raise InvalidArgument(
            f"model '{config.name}': a TorchScript model does not record its input types; declare its "
            f"inputs in config.pbtxt (forward takes: {', '.join(args) or 'no tensors'}), "
            'for example: input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ -1 ] } ]'
        )
    torch = _torch()
    feed = []
    batch = [1] if config.max_batch_size > 0 else []
    for name in _order([i.name for i in config.input], args):
        spec = next(i for i in config.input if i.name == name)
        shape = batch + [d if d > 0 else 1 for d in spec.dims]
        dtype = numpy_dtype(config_to_wire(data_type_name(spec.data_type)))
        feed.append(torch.from_numpy(np.zeros(shape, dtype=dtype)))
    try:
        with torch.no_grad():
            result = module(*feed)
    except Exception as exc:
        raise InvalidArgument(
            f"model '{config.name}': could not derive outputs by running forward on zeros ({exc}); "
            "declare the outputs in config.pbtxt"
        ) from None
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    for i, t in enumerate(results):
        out = config.output.add()
        out.name = f"OUTPUT__{i}"
        dtype = _TORCH_TO_CONFIG.get(str(t.dtype))
        if dtype is None:
            raise InvalidArgument(f"model '{config.name}': output {i} has unsupported dtype {t.dtype}")
        out.data_type = dtype
        out.dims.extend([-1] * (t.dim() - len(batch)) or [1])


class _Module:
    """An instance's engine: the TorchScript module on its device, and the positional order of its tensors."""

    def __init__(self, torch, device, module, input_order: list[str], output_order: list[str]):
        self.torch = torch
        self.device = device
        self.module = module
        self.input_order = input_order
        self.output_order = output_order


class TorchBackend(ModelFileBackend):
    """One TorchScript module per instance, through the same lifecycle API every plug-in uses."""

    name = "pytorch"
    default_model_filename = "model.pt"

    auto_complete = staticmethod(auto_complete)

    def instance_initialize(self, instance: InstanceState) -> None:
        torch = _torch()
        model = instance.model
        if instance.kind == "GPU":
            if not torch.cuda.is_available():
                raise Unavailable(
                    f"model '{model.name}' asks for a GPU instance but torch has no CUDA device"
                )
            device = torch.device(f"cuda:{instance.device_id}")
            # GPU inputs are read in place from the request's read-only bytes (nothing writes through the view;
            # the copy to the device is the only one): torch's note about read-only arrays says nothing here
            warnings.filterwarnings("ignore", _READ_ONLY_NOTE, UserWarning)
        else:
            device = torch.device("cpu")
            with _threads_lock:
                total = sum(g.count for g in model.config.instance_group) or 1
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // total))
        module = _load(model.model_file, str(device))
        args = _forward_args(module)
        instance.state = _Module(
            torch,
            device,
            module,
            _order([i.name for i in model.config.input], args),
            _order([o.name for o in model.config.output], []),
        )

    def instance_execute(self, instance: InstanceState, requests):
        batch = instance.gather(requests)
        engine: _Module = instance.state
        torch = engine.torch
        feed = []
        for name in engine.input_order:
            arr = batch.inputs[name]
            if arr.dtype == np.object_:
                raise InvalidArgument(f"input '{name}': the pytorch backend does not take BYTES tensors here")
            if engine.device.type == "cuda":
                host = torch.from_numpy(arr)  # read in place: the copy to the device is the only one
            else:
                # On the CPU the module works on the tensor itself and may write to it: a copy of read-only bytes
                host = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
            feed.append(host.to(engine.device))
        try:
            with torch.inference_mode():
                result = engine.module(*feed)
        except Exception as exc:
            raise InvalidArgument(f"PyTorch execute failure: {exc}") from None
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(results) < len(engine.output_order):
            raise InvalidArgument(
                f"model '{instance.model.name}' returned {len(results)} outputs, "
                f"config declares {len(engine.output_order)}"
            )
        by_name = dict(zip(engine.output_order, results))
        out = {name: by_name[name].detach().cpu().numpy() for name in batch.outputs}
        return instance.scatter(requests, batch, out)


# Registered under the entry-point group naiad.backends (pyproject.toml).
backend = TorchBackend()
