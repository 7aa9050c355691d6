"""Triton's ensemble scheduler: a DAG of steps run by data dependency; independent steps run concurrently
through Server.infer."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from ..backends.base import ModelContext
from ..errors import InvalidArgument, NaiadError
from ..inference import InferenceRequest, InferenceResponse, OutputTensor, RequestedOutput
from ..stats import ModelStats


def _check_graph(ctx: ModelContext) -> None:
    """Every tensor a step reads is an ensemble input or another step's output; every output is produced."""
    config = ctx.config
    steps = list(config.ensemble_scheduling.step)
    if not steps:
        raise InvalidArgument(f"ensemble '{ctx.name}' has no ensemble_scheduling steps")
    available = {i.name for i in config.input}
    produced: dict[str, int] = {}
    for idx, step in enumerate(steps):
        if not step.model_name:
            raise InvalidArgument(f"ensemble '{ctx.name}' step {idx} names no model")
        for tensor in step.output_map.values():
            if tensor in produced or tensor in available:
                raise InvalidArgument(f"ensemble '{ctx.name}': tensor '{tensor}' is produced more than once")
            produced[tensor] = idx
    known = available | set(produced)
    for idx, step in enumerate(steps):
        for model_input, tensor in step.input_map.items():
            if tensor not in known:
                raise InvalidArgument(
                    f"ensemble '{ctx.name}' step {idx} ('{step.model_name}') reads tensor '{tensor}' for input "
                    f"'{model_input}', but no ensemble input or step output provides it"
                )
    for out in config.output:
        if out.name not in produced:
            raise InvalidArgument(f"ensemble '{ctx.name}': output '{out.name}' is not produced by any step")
    # cycle check: repeatedly mark steps whose inputs are available
    ready, pending = set(available), set(range(len(steps)))
    while pending:
        runnable = {i for i in pending if set(steps[i].input_map.values()) <= ready}
        if not runnable:
            names = ", ".join(steps[i].model_name for i in sorted(pending))
            raise InvalidArgument(f"ensemble '{ctx.name}' has a cycle among steps: {names}")
        for i in runnable:
            ready |= set(steps[i].output_map.values())
        pending -= runnable


class EnsembleScheduler:
    """Runs an ensemble's steps for each request (a `scheduling.scheduler.Scheduler`); `server` runs each step."""

    def __init__(self, ctx: ModelContext, stats: ModelStats, server):
        _check_graph(ctx)
        self.ctx = ctx
        self.stats = stats
        self.server = server
        self.steps = list(ctx.config.ensemble_scheduling.step)
        self.output_types = {o.name: o for o in ctx.config.output}

    async def submit(self, request: InferenceRequest) -> InferenceResponse:
        ctx, stats, steps, server = self.ctx, self.stats, self.steps, self.server
        start = time.monotonic_ns()
        tensors = {name: (arr, request.datatypes[name]) for name, arr in request.inputs.items()}
        remaining = list(range(len(steps)))
        running: dict[asyncio.Task, int] = {}
        ok = False
        try:
            while remaining or running:
                for idx in [i for i in remaining if all(t in tensors for t in steps[i].input_map.values())]:
                    remaining.remove(idx)
                    running[asyncio.ensure_future(_run_step(server, request, steps[idx], tensors))] = idx
                if not running:
                    raise InvalidArgument(f"ensemble '{ctx.name}': steps cannot make progress")
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    idx = running.pop(task)
                    try:
                        resp = task.result()
                    except NaiadError as exc:
                        raise type(exc)(
                            f"in ensemble '{ctx.name}', step '{steps[idx].model_name}': {exc.message}"
                        ) from None
                    for model_output, tensor in steps[idx].output_map.items():
                        out = resp.output(model_output)
                        if out is None:
                            raise InvalidArgument(
                                f"in ensemble '{ctx.name}', step '{steps[idx].model_name}' did not return "
                                f"output '{model_output}'"
                            )
                        tensors[tensor] = (out.data, out.datatype)
            names = [o.name for o in request.outputs] or list(self.output_types)
            outputs = [OutputTensor(n, tensors[n][1], tensors[n][0]) for n in names]
            ok = True
            return InferenceResponse(
                model_name=ctx.name,
                model_version=str(ctx.version),
                outputs=outputs,
                id=request.id,
                # a GPU model's output went straight to the end: the caller (or Server.infer) decides where
                device_outputs=any(o.data.__class__ is not np.ndarray for o in outputs),
            )
        finally:
            for task in running:
                task.cancel()
            total = time.monotonic_ns() - start
            if ok:
                stats.record_execution(request.batch_size(ctx.config.max_batch_size > 0), 0, total, 0)
            stats.record_request(ok, time.monotonic_ns() - request.arrival_ns, 0, 0, total, 0)

    async def close(self, timeout: float | None = None) -> None:
        """Nothing of its own to drain: each step's requests are its models' (their schedulers drain them)."""


async def _run_step(server, parent: InferenceRequest, step, tensors) -> InferenceResponse:
    inputs = {model_input: tensors[t][0] for model_input, t in step.input_map.items()}
    datatypes = {model_input: tensors[t][1] for model_input, t in step.input_map.items()}
    req = InferenceRequest(
        model_name=step.model_name,
        inputs=inputs,
        datatypes=datatypes,
        model_version=step.model_version if step.model_version > 0 else -1,
        id=parent.id,
        outputs=[RequestedOutput(name) for name in step.output_map],
        parameters=parent.parameters,
        correlation_id=parent.correlation_id,
        flags=parent.flags,
        priority=parent.priority,
        timeout_us=parent.timeout_us,
        traceparent=parent.trace,
        # tensors in device memory go from step to step as they are; each step's model says where it takes them
        device_inputs=any(v.__class__ is not np.ndarray for v in inputs.values()),
        device_consumer=True,
    )
    return await server.infer(req)
