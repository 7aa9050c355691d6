"""The sequence batcher's implicit state (`sequence_batching.state`): validated as Triton does, with each
state's initial value.

The state input carries the previous request's state output of the same sequence; at START it is the
initial state (`zero_data`, `<model_dir>/initial_state/<data_file>`, or zeros with variable dims as 1 when
no `initial_state` is given). The state output is removed from the client's
response unless the output is also declared in `config.output` and requested (Triton's debugging case).
A failed request leaves the state as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..config import data_type_name
from ..errors import InvalidArgument
from ..tensors import config_to_wire, deserialize_bytes, numpy_dtype


@dataclass
class State:
    """One implicit state: its input and output tensor names, wire datatype and initial value."""

    input_name: str
    output_name: str
    datatype: str
    initial: np.ndarray  # batch dimension included when max_batch_size > 0


def parse_states(config: mc.ModelConfig, model_dir) -> list[State]:
    """Validate `state` as Triton does and build each state's initial value."""
    name = config.name
    batched = config.max_batch_size > 0
    states: list[State] = []
    seen: set[str] = set()
    for st in config.sequence_batching.state:
        if not st.input_name or not st.output_name:
            raise InvalidArgument(
                f"model '{name}': a sequence batching state needs input_name and output_name"
            )
        if st.input_name in seen:
            raise InvalidArgument(f"State input name '{st.input_name}' specified more than once.")
        seen.add(st.input_name)
        if st.data_type == mc.TYPE_INVALID:
            raise InvalidArgument(f"model '{name}': state '{st.input_name}' has no data_type")
        datatype = config_to_wire(data_type_name(st.data_type))
        if len(st.initial_state) > 1:
            raise InvalidArgument(
                f"initial_state field for state input '{st.input_name}' must contain exactly one or zero "
                f"element. Found '{len(st.initial_state)}' elements."
            )
        if st.initial_state:
            initial = _initial_state(config, st, st.initial_state[0], model_dir)
        else:
            # Triton leaves the first input state uninitialised (variable dims as 1); Naiad gives zeros.
            shape = ([1] if batched else []) + [1 if d == -1 else d for d in st.dims]
            initial = _zeros(shape, datatype)
        states.append(State(st.input_name, st.output_name, datatype, initial))
    return states


def _zeros(shape, datatype: str) -> np.ndarray:
    if datatype == "BYTES":
        arr = np.empty(shape, dtype=np.object_)
        arr[...] = b""
        return arr
    return np.zeros(shape, dtype=numpy_dtype(datatype))


def _initial_state(config, st, init, model_dir) -> np.ndarray:
    if init.data_type != st.data_type:
        raise InvalidArgument(
            f"The data type used for 'initial_state' field of state '{st.input_name}' does "
            "not match the state data type."
        )
    if not init.name:
        raise InvalidArgument(
            f"Field 'name' must be set when using initial_state for state input '{st.input_name}'."
        )
    if len(init.dims) != len(st.dims):
        raise InvalidArgument(
            "Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions for state "
            f"input '{st.input_name}'. {len(init.dims)} != {len(st.dims)}"
        )
    for idim, sdim in zip(init.dims, st.dims):
        if idim == -1:
            raise InvalidArgument(
                f"'initial_state' field for state input name '{st.input_name}' contains variable dimensions."
            )
        if sdim != -1 and idim != sdim:
            raise InvalidArgument(
                f"'initial_state' dim for input name '{st.input_name}' doesn't match "
                f"'state' dim description. {idim} != {sdim}"
            )
    shape = ([1] if config.max_batch_size > 0 else []) + list(init.dims)
    datatype = config_to_wire(data_type_name(st.data_type))
    count = int(np.prod(shape)) if shape else 1
    which = init.WhichOneof("state_data")
    if which == "zero_data":
        return _zeros(shape, datatype)
    if which != "data_file":
        raise InvalidArgument(
            f"'initial_state' of state input '{st.input_name}' must set zero_data or data_file"
        )
    if model_dir is None:
        raise InvalidArgument(f"model '{config.name}': no model directory to read initial state from")

    path = Path(model_dir) / "initial_state" / init.data_file
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(
            f"model '{config.name}': failed to read initial state file {path}: {exc.strerror or exc}"
        ) from None
    if datatype == "BYTES":
        return deserialize_bytes(raw, count).reshape(shape)
    dtype = numpy_dtype(datatype)
    need = count * dtype.itemsize
    if len(raw) < need:
        raise InvalidArgument(
            f"initial_state setting expects {need} bytes, but the data provided from "
            f"{init.data_file} only has {len(raw)} bytes."
        )
    return np.frombuffer(raw[:need], dtype=dtype).reshape(shape).copy()
