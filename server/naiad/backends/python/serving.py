"""What the server does for a worker process's side-channel requests: its BLS requests and model control and
custom metric calls, run on the server's loop, and its log records (the server side of `worker.RemoteServer`)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable

from ...errors import Internal, InvalidArgument
from ...inference import InferenceRequest
from ..base import ModelContext
from .wire import decode_request, encode_response, transferable_error

SERVER_CALLS = ("load_model", "unload_model", "model_ready")  # what a worker may ask the server loop to run

Send = Callable[[tuple], None]  # sends a side-channel message to the worker


def serve_call(ctx: ModelContext, owner: object, send: Send, call: int, method: str, args: tuple) -> None:
    """A worker's model control or custom metric call (`pb_utils.load_model`, `MetricFamily`, ...); the answer
    goes back as ("call_reply", call, value, error). Custom metrics the worker creates belong to `owner`."""
    server, loop = ctx.server, ctx.loop

    def reply(value, error) -> None:
        send(("call_reply", call, value, error))

    if server is None or loop is None:
        reply(None, Internal(f"pb_utils call '{method}' needs a running Naiad server"))
        return
    store = server.custom_metrics
    metric_calls = {
        "metric_family": lambda name, description, kind: store.family(name, description, kind, owner),
        "metric": lambda family, labels, buckets: store.metric(family, labels, buckets, owner),
        "metric_value": store.value,
    }
    if method in metric_calls:
        try:
            reply(metric_calls[method](*args), None)
        except Exception as exc:
            reply(None, transferable_error(exc))
        return
    if method not in SERVER_CALLS:
        reply(None, InvalidArgument(f"unknown server call '{method}' from the python worker"))
        return

    async def run():
        result = getattr(server, method)(*args)
        if inspect.isawaitable(result):
            result = await result
        return result

    def done(future) -> None:
        try:
            reply(future.result(), None)
        except BaseException as exc:
            reply(None, transferable_error(exc))

    asyncio.run_coroutine_threadsafe(run(), loop).add_done_callback(done)


def start_bls(
    ctx: ModelContext,
    send: Send,
    streams: dict[int, InferenceRequest],
    lock: threading.Condition,
    bls: int,
    fields: tuple,
    decoupled: bool,
) -> None:
    """Run a BLS request of the worker on the server loop; the result goes back as side messages. A decoupled
    one is in `streams` (under `lock`) while it runs, so that the worker can cancel it."""
    server, loop = ctx.server, ctx.loop
    if server is None or loop is None:
        send(("bls_reply", bls, None, Internal("BLS requests need a running Naiad server")))
        return
    native = decode_request(fields)
    if decoupled:
        # as in-process: the model's iterator sees what the server hands to the request's callback
        native.response_callback = lambda r: send(("bls_stream", bls, encode_response(r)))
        with lock:
            streams[bls] = native

        async def run_stream() -> None:
            async for _ in server.infer_stream(native):
                pass

        future = asyncio.run_coroutine_threadsafe(run_stream(), loop)
    else:
        future = asyncio.run_coroutine_threadsafe(server.infer(native), loop)

    def done(f) -> None:
        with lock:
            streams.pop(bls, None)
        try:
            result = f.result()
        except BaseException as exc:
            send(("bls_reply", bls, None, transferable_error(exc)))
            return
        send(("bls_reply", bls, None if decoupled else encode_response(result), None))

    future.add_done_callback(done)


def log_record(name: str, level: int, text: str) -> None:
    """A log record of the model in the worker, handled by the server's logging."""
    logger = logging.getLogger(name)
    if logger.isEnabledFor(level):
        logger.handle(
            logging.makeLogRecord(
                {
                    "name": name,
                    "levelno": level,
                    "msg": text,
                    "args": None,
                    "levelname": logging.getLevelName(level),
                }
            )
        )
