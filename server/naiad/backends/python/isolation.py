"""Whether a python model's instances run in-process (threads) or in worker processes.

Why: in-process python instances (`PythonInstance`) share the server's GIL, so `instance_group
{ count: 2 kind: KIND_CPU }` on a CPU-bound python model gives no speed-up. Triton runs every python
instance in a stub process; `ProcessInstance` does the same, paying one process hop per execution.

Choice (`execution_isolation`): the model parameter `EXECUTION_ISOLATION` ("process" or "thread")
forces the mode. Otherwise a model with more than one instance (over all instance groups) runs in
process mode and a model with a single instance runs in-process. The figures behind the rule
(`bench/python_instances.py`: in-process Server API, 8 concurrent clients, 2-core machine, requests/s,
best (median) of 12 one-second rounds; the bench ran in its own session at autogroup nice -20
because concurrent builds otherwise left it one core: two plain processes took 1.1x one):

    model                            count=1 thread     count=2 thread    count=2 process
    cpu_burn (200k loop steps)          58.5 (54.3)        60.0 (53.1)       116.9 (89.9)
    identity_fp32 (1x16 FP32)         26836 (23939)      26946 (23874)        3241 (2851)

and over HTTP (wrk, 8 connections, binary tensors, same machine): identity_fp32 4000-4700 req/s
with count=1 thread, 3550-4200 with count=2 thread, 1500-1950 with count=2 process.

Threads give a CPU-bound model nothing (the GIL); two processes double it. The hop costs about
150 us of CPU per execution (pickling, two socket wake-ups), which is most of the time of a trivial
model: 8x on the bare Server API, 2.3x behind HTTP. Several instances are how a Triton user asks for
several executions at once, which for python code only processes deliver; so count > 1 means
processes, and a model whose executions are cheap can say `EXECUTION_ISOLATION: thread`. A single
instance gains nothing from a process and would only pay the hop, so it stays in-process.
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

from ...config import ModelConfig
from ...errors import InvalidArgument

ISOLATION_PARAMETER = "EXECUTION_ISOLATION"
ISOLATION_MODES = ("process", "thread")


def instance_count(config: ModelConfig) -> int:
    """How many instances the repository creates for `config` (one per count per listed GPU)."""
    total = 0
    for group in config.instance_group:
        devices = len(group.gpus) if group.kind == mc.ModelInstanceGroup.KIND_GPU and group.gpus else 1
        total += group.count * devices
    return total


def execution_isolation(config: ModelConfig) -> str:
    """ "process" or "thread" for a python model: the EXECUTION_ISOLATION parameter, else by instance count."""
    if ISOLATION_PARAMETER in config.parameters:
        value = config.parameters[ISOLATION_PARAMETER].string_value.strip().lower()
        if value not in ISOLATION_MODES:
            raise InvalidArgument(
                f"model '{config.name}': parameter {ISOLATION_PARAMETER} must be "
                f"'process' or 'thread', got '{value}'"
            )
        return value
    return "process" if instance_count(config) > 1 else "thread"
