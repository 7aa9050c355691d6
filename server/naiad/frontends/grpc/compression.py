"""gRPC request message decompression (grpc-encoding gzip/deflate) for Naiad's HTTP/2 server: inflated in
bounded steps, off the event loop unless small, and stopped as soon as the message passes the message size
limit or inflates past a ratio to its compressed size (as Envoy's max_inflate_ratio), so that a small bomb
costs little memory and time and is answered at once."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from .messages import Abort

INLINE_INFLATE = (
    8192  # compressed messages up to this size are inflated on the event loop, larger ones off it
)
RATIO_FLOOR = 4 << 20  # the ratio limit applies only to messages that inflate past this many bytes
DEFAULT_MAX_RATIO = 100  # Envoy's max_inflate_ratio default
_IN_STEP = 64 << 10  # compressed bytes handed to zlib at a time (its unconsumed tail is a copy)
_OUT_STEP = (
    1 << 20
)  # inflated bytes per step: the limits are checked, and a cancelled call noticed, between them

_WBITS = {b"gzip": 31, b"deflate": zlib.MAX_WBITS}


def inflate(
    encoding: bytes,
    payload,
    limit: int,
    max_ratio: int = DEFAULT_MAX_RATIO,
    cancelled: Callable[[], bool] | None = None,
) -> memoryview:
    """A compressed message inflated to at most `limit` bytes and (once past RATIO_FLOOR) `max_ratio` times
    its compressed size (0: no ratio limit); beyond either, RESOURCE_EXHAUSTED with the rest never inflated.
    An undecodable or truncated stream: INTERNAL (grpc core's answer to a message it cannot decompress).
    `cancelled()` true between steps (the call ended): CANCELLED. The message is a read-only view (as the bytes
    of an uncompressed one are: tensors made from it are read-only too)."""
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise Abort(grpc.StatusCode.UNIMPLEMENTED, "unsupported grpc-encoding (gzip and deflate are served)")
    n = len(payload)
    ratio_cap = max(RATIO_FLOOR, max_ratio * n) if max_ratio else None
    d = zlib.decompressobj(wbits)
    out = bytearray()  # grows in place (realloc; mremap for large blocks): no second copy at the end
    view = memoryview(payload)
    error: tuple[grpc.StatusCode, str] | None = None
    data: bytes | memoryview | None = None
    try:
        for pos in range(0, n, _IN_STEP):
            data = view[pos : pos + _IN_STEP]
            while data and error is None:
                if cancelled is not None and cancelled():
                    error = (grpc.StatusCode.CANCELLED, "the call ended while its message was inflated")
                    break
                out += d.decompress(data, _OUT_STEP)
                if len(out) > limit:
                    error = (
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Received message larger than max ({len(out)} vs. {limit}) after decompression",
                    )
                elif ratio_cap is not None and len(out) > ratio_cap:
                    error = (
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the compressed message ({n} bytes) inflates to more than {max_ratio} times its size "
                        "(--grpc-max-decompression-ratio)",
                    )
                data = d.unconsumed_tail
            if error is not None or d.eof:
                break
    except zlib.error as exc:
        error = (grpc.StatusCode.INTERNAL, f"failed to decompress the request message: {exc}")
    if error is None and not d.eof:
        error = (grpc.StatusCode.INTERNAL, "failed to decompress the request message: truncated")
    if error is not None:
        inflated = len(out)
        del out, data, view  # (the Abort's traceback holds this frame: it must not hold the inflated bytes)
        abort = Abort(*error)
        abort.inflated = inflated
        raise abort
    return memoryview(out).toreadonly()


async def decompress(
    loop,
    encoding: bytes,
    payload,
    limit: int,
    max_ratio: int = DEFAULT_MAX_RATIO,
    cancelled: Callable[[], bool] | None = None,
) -> memoryview:
    """`inflate`, off the event loop unless the message is small (one at a time per server, in one thread:
    bombs cannot multiply, and zlib releases the GIL while it inflates)."""
    if len(payload) <= INLINE_INFLATE:
        return inflate(encoding, payload, limit, max_ratio)
    return await loop.run_in_executor(_inflater(), inflate, encoding, payload, limit, max_ratio, cancelled)


_INFLATER: ThreadPoolExecutor | None = None


def _inflater() -> ThreadPoolExecutor:
    global _INFLATER
    if _INFLATER is None:
        _INFLATER = ThreadPoolExecutor(1, thread_name_prefix="naiad-grpc-inflate")
    return _INFLATER
