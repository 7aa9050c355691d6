"""Example backend 'affine': OUTPUT0 = INPUT0 * scale + offset and OUTPUT1 = its row sums, on Naiad's API."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from naiad.backends.api import Backend, InstanceState, InvalidArgument, ModelState

log = logging.getLogger("naiad_example_backend")


@dataclass
class Affine:
    """What every instance of one model version shares: the parameters, read once."""

    scale: float
    offset: float


class AffineBackend(Backend):
    def initialize(self) -> None:
        log.info("affine backend initialized")

    def finalize(self) -> None:
        log.info("affine backend finalized")

    def model_initialize(self, model: ModelState) -> None:
        params = model.parameters
        try:
            model.state = Affine(float(params.get("scale", "1")), float(params.get("offset", "0")))
        except ValueError as exc:
            raise ValueError(f"parameters scale and offset must be numbers: {exc}") from None
        log.info("affine model %s version %d initialized: %s", model.name, model.version, model.state)

    def model_finalize(self, model: ModelState) -> None:
        log.info("affine model %s version %d finalized", model.name, model.version)

    def instance_initialize(self, instance: InstanceState) -> None:
        log.info("affine instance %s initialized on %s %d", instance.name, instance.kind, instance.device_id)

    def instance_execute(self, instance: InstanceState, requests):
        affine: Affine = instance.model.state
        if instance.model.decoupled:
            # One response per row, then the final flag: a stream, as a decoupled model sends it.
            for request in requests:
                sender = instance.sender(request)
                for row in request.inputs["INPUT0"]:
                    y = row[None] * affine.scale + affine.offset
                    sender.send({"OUTPUT0": y, "OUTPUT1": y.sum(axis=1, keepdims=True)})
                sender.send(final=True)
            return None
        # A request with a NaN fails alone; the others of the batch still run together.
        good = [r for r in requests if not np.isnan(r.inputs["INPUT0"]).any()]
        responses = {}
        if good:
            batch = instance.gather(good)
            y = batch.inputs["INPUT0"] * affine.scale + affine.offset
            outputs = {
                "OUTPUT0": y.astype(np.float32),
                "OUTPUT1": y.sum(axis=1, keepdims=True).astype(np.float32),
            }
            # scatter only returns the outputs each request asked for
            responses = dict(zip(map(id, good), instance.scatter(good, batch, outputs)))
        return [
            responses.get(id(r)) or instance.error(r, InvalidArgument("INPUT0 contains NaN"))
            for r in requests
        ]


backend = AffineBackend()
