"""Whether a python model's instances run in-process (threads) or in worker processes: a question of its config alone,
asked by the python backend (`backends/python`) and by `device_tensors` (which models take GPU inputs as they are).

Why: in-process python instances (`PythonInstance`) share the server's GIL, so `instance_group
{ count: 2 kind: KIND_CPU }` on a CPU-bound python model gives no speed-up. Triton runs every python
instance in a stub process; `ProcessInstance` does the same, paying one process hop per execution.

Choice (`execution_isolation`): the model parameter `EXECUTION_ISOLATION` ("process" or "thread")
forces the mode. Otherwise a model with more than one instance (over all instance groups) runs in
process mode and a model with a single instance runs in-process. The figures behind the rule
(`bench/python_instances.py --seconds 1 --rounds 6`: in-process Server API, 8 concurrent clients,
2-core machine, requests/s, best (median) of 6 one-second rounds; the machine check read 1.01-1.03x,
two free cores), 2026-11-26, after small executions of process instances moved onto the event loop
(`ProcessInstance.execute_async`; the previous tree in the same session in brackets):

    model                            count=1 thread     count=2 thread    count=2 process
    cpu_burn (200k loop steps)          99.4 (98.5)        99.7 (96.6)       201.2 (196.9)   [195.7 (190.2)]
    identity_fp32 (1x16 FP32)        69092 (67200)      69017 (68622)      11246 (11147)   [4550 (4258)]

and over HTTP and gRPC (`bench/frontend_workers.py --instances 4`, the python identity with 4 process
instances at c64 / over 8 connections): 7,667 and 7,042 requests/s at 199 and 221 µs of CPU each
(server and workers together), against 3,136 and 2,979 at 403 and 414 µs through instance threads.

Threads give a CPU-bound model nothing (the GIL); two processes double it. The hop costs about
60 us of the server's CPU per execution (pickling, a socket write and an event-loop wake-up each way;
HTTP at c64: 118 us a request with 4 process instances against 59 us with one in-process) and 20 us of
the worker's: most of the time of a trivial model, 6x on the bare Server API. Several instances are how a Triton user
asks for several executions at once, which for python code only processes deliver; so count > 1 means
processes, and a model whose executions are cheap can say `EXECUTION_ISOLATION: thread`. A single
instance gains nothing from a process and would only pay the hop, so it stays in-process.
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc

from .errors import InvalidArgument

ISOLATION_PARAMETER = "EXECUTION_ISOLATION"
ISOLATION_MODES = ("process", "thread")


def instance_count(config: mc.ModelConfig) -> int:
    """How many instances the repository creates for `config` (one per count per listed GPU)."""
    total = 0
    for group in config.instance_group:
        devices = len(group.gpus) if group.kind == mc.ModelInstanceGroup.KIND_GPU and group.gpus else 1
        total += group.count * devices
    return total


def execution_isolation(config: mc.ModelConfig) -> str:
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
