"""Tensors in GPU memory inside the server: the DLPack holder requests and responses carry, and the host copies.

Request inputs and response outputs are numpy arrays. A tensor may instead be a `DeviceTensor` (GPU memory, held
through DLPack) where both ends want that: a python model with `FORCE_CPU_ONLY_INPUT_TENSORS: "no"` (and an
ensemble, which only passes tensors along) takes device inputs, and such a model's GPU outputs stay on the device
for a caller that takes them (an ensemble step, a BLS call from such a model). Everyone else gets host memory: the
server copies at the boundary (`Server.infer`), so frontends, caches and other backends only ever see numpy. A
request or response says it carries device tensors with a flag (`device_inputs`, `device_outputs`), so the host
path pays one attribute test.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InvalidArgument
from .python_isolation import execution_isolation

#: The python backend's parameter (Triton's name and values): "no" keeps GPU inputs on the GPU.
FORCE_CPU_ONLY = "FORCE_CPU_ONLY_INPUT_TENSORS"
_DLPACK_CPU = 1


def force_cpu_only(config) -> bool:
    """A python model's FORCE_CPU_ONLY_INPUT_TENSORS: "yes" (the default) or "no", as Triton spells them."""
    if FORCE_CPU_ONLY not in config.parameters:
        return True
    value = config.parameters[FORCE_CPU_ONLY].string_value
    if value == "yes":
        return True
    if value == "no":
        return False
    raise InvalidArgument(f"Incorrect value for {FORCE_CPU_ONLY}: {value}' (expected 'yes' or 'no')")


def takes_device_inputs(config) -> bool:
    """Whether a model receives GPU inputs as they are: an ensemble, or an in-process python model that turned the
    copy off (worker processes receive their tensors through host memory)."""
    if config.platform == "ensemble":
        return True
    if config.backend != "python" or force_cpu_only(config):
        return False
    return execution_isolation(config) == "thread"


def is_device(obj: Any) -> bool:
    """Whether a DLPack producer holds memory off the host (torch CUDA tensors, cupy arrays, DeviceTensors)."""
    probe = getattr(obj, "__dlpack_device__", None)
    return probe is not None and int(probe()[0]) != _DLPACK_CPU


class DeviceTensor:
    """A tensor in device memory. Held as a torch tensor (torch reads any DLPack producer without a copy); exposes
    what the server's checks read (`shape`, `dtype`, `ndim`, `nbytes`) and DLPack for the model."""

    __slots__ = ("_tensor",)

    def __init__(self, source: Any):
        import torch

        self._tensor = source if isinstance(source, torch.Tensor) else torch.from_dlpack(source)

    @property
    def torch(self):
        return self._tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._tensor.shape)

    @property
    def ndim(self) -> int:
        return self._tensor.dim()

    @property
    def size(self) -> int:
        return self._tensor.numel()

    @property
    def dtype(self) -> np.dtype:
        import torch

        if self._tensor.dtype == torch.bool:
            return np.dtype(np.bool_)
        if self._tensor.dtype == torch.bfloat16:
            return np.dtype(np.uint16)  # numpy's stand-in for BF16, as on the host
        return np.dtype(str(self._tensor.dtype).removeprefix("torch."))

    @property
    def nbytes(self) -> int:
        return self._tensor.numel() * self._tensor.element_size()

    @property
    def device_id(self) -> int:
        return int(self._tensor.device.index or 0)

    def reshape(self, *shape) -> DeviceTensor:
        return DeviceTensor(self._tensor.reshape(*shape))

    def __getitem__(self, key) -> DeviceTensor:
        return DeviceTensor(self._tensor[key])

    def __dlpack__(self, *args, **kwargs):
        return self._tensor.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()

    def to_host(self) -> np.ndarray:
        import torch

        t = self._tensor.detach()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
            return t.cpu().numpy().view(np.uint16)
        return t.cpu().numpy()

    def __repr__(self) -> str:
        return f"DeviceTensor(shape={list(self.shape)}, dtype={self.dtype}, device={self._tensor.device})"


def to_host(value: Any) -> Any:
    """Host memory for a tensor (numpy arrays pass through; anything lazy or on a device is copied)."""
    host = getattr(value, "to_host", None)
    return host() if host is not None else value


def place_inputs(request, config) -> None:
    """Before the model of `config` sees `request`: its inputs in device memory where it takes them, else on the
    host. An ensemble passes them on as they are (each step's model decides)."""
    if config.platform == "ensemble":
        return
    on_device = takes_device_inputs(config)
    keep = False
    for name, value in request.inputs.items():
        if on_device:
            to_device = getattr(value, "to_device", None)
            if to_device is not None:  # a lazy span of CUDA shared memory: device to device, once
                value = request.inputs[name] = to_device()
            keep = keep or isinstance(value, DeviceTensor)
        else:
            request.inputs[name] = to_host(value)
    request.device_inputs = keep


def outputs_to_host(response) -> None:
    """The response's outputs in host memory (what frontends encode and caches keep)."""
    for out in response.outputs:
        out.data = to_host(out.data)
    response.device_outputs = False
