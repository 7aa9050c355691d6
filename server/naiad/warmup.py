"""Model warmup (`model_warmup`): run sample requests on every instance before the model is ready."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .backends.base import Timing
from .config import data_type_name
from .errors import InvalidArgument, as_naiad_error
from .inference import InferenceRequest
from .tensors import config_to_wire, numpy_dtype

log = logging.getLogger("naiad.warmup")


def sample_inputs(mv, sample: mc.ModelWarmup) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Build the inputs of one warmup sample (zero, random or file data), batch dimension included."""
    inputs, datatypes = {}, {}
    batch = max(1, sample.batch_size)
    for name, spec in sample.inputs.items():
        datatype = config_to_wire(data_type_name(spec.data_type))
        shape = ([batch] if mv.max_batch_size > 0 else []) + list(spec.dims)
        count = int(np.prod(shape)) if shape else 1
        kind = spec.WhichOneof("input_data_type")
        if datatype == "BYTES":
            if kind == "input_data_file":
                raw = (mv.ctx.model_dir / "warmup" / spec.input_data_file).read_bytes()
                arr = np.array([raw] * count, dtype=np.object_)
            else:
                arr = np.array([b"0" if kind == "zero_data" else b"\x01"] * count, dtype=np.object_)
        else:
            dtype = numpy_dtype(datatype)
            if kind == "random_data":
                arr = (
                    np.random.default_rng().random(count).astype(dtype)
                    if dtype.kind == "f"
                    else np.random.default_rng()
                    .integers(0, 2 if dtype.kind == "b" else 100, count)
                    .astype(dtype)
                )
            elif kind == "input_data_file":
                path = mv.ctx.model_dir / "warmup" / spec.input_data_file
                arr = np.fromfile(path, dtype=dtype)[:count]
                if arr.size != count:
                    raise InvalidArgument(
                        f"warmup file {path} holds {arr.size} elements, sample needs {count}"
                    )
            else:
                arr = np.zeros(count, dtype=dtype)
        inputs[name] = arr.reshape(shape)
        datatypes[name] = datatype
    return inputs, datatypes


def run_warmup(mv) -> None:
    """Run each sample `count` times on every instance, on the instance's own thread; raise on failure.

    Ensembles (beyond Triton, which refuses them: server#6877) run each sample through all their steps.
    Called on a loader thread, never on the event loop.
    """
    samples = list(mv.config.model_warmup)
    if not samples:
        return
    if mv.pool is None:
        _warm_ensemble(mv, samples)
        return
    for sample in samples:
        inputs, datatypes = sample_inputs(mv, sample)
        for inst in mv.pool.instances:
            for _ in range(max(1, sample.count)):
                req = InferenceRequest(
                    model_name=mv.name,
                    inputs=dict(inputs),
                    datatypes=datatypes,
                    model_version=mv.version,
                    id=f"warmup:{sample.name}",
                    response_callback=_discard,
                )
                try:
                    if mv.input_reshape:  # samples are given in `dims`, as requests are
                        mv.reshape_inputs(req)
                    mv.pool.execute_on(inst, inst.execute, [req], Timing()).result()
                except Exception as exc:
                    err = as_naiad_error(exc)
                    raise InvalidArgument(
                        f"model '{mv.name}' warmup sample '{sample.name}' failed: {err.message}"
                    ) from None
        log.info(
            "model '%s' version %s: warmup sample '%s' ran on %d instance(s)",
            mv.name,
            mv.version,
            sample.name,
            len(mv.pool.instances),
        )


def _discard(response) -> None:
    """Decoupled models send warmup responses here."""


def _warm_ensemble(mv, samples) -> None:
    loop = mv.ctx.loop
    for sample in samples:
        inputs, datatypes = sample_inputs(mv, sample)
        for _ in range(max(1, sample.count)):
            req = InferenceRequest(
                model_name=mv.name,
                inputs=inputs,
                datatypes=datatypes,
                model_version=mv.version,
                id=f"warmup:{sample.name}",
            )
            try:
                asyncio.run_coroutine_threadsafe(mv.scheduler.submit(req), loop).result()
            except Exception as exc:
                err = as_naiad_error(exc)
                raise InvalidArgument(
                    f"ensemble '{mv.name}' warmup sample '{sample.name}' failed: {err.message}"
                ) from None
        log.info(
            "ensemble '%s' version %s: warmup sample '%s' ran through every step",
            mv.name,
            mv.version,
            sample.name,
        )
