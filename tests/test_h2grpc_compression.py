"""grpc/compression.py inflate: bounded by the message limit and the ratio, in steps, with gRPC statuses."""

import gzip
import time
import zlib

import pytest
from google.protobuf.message import DecodeError

from naiad.frontends.grpc import wire
from naiad.frontends.grpc.compression import RATIO_FLOOR, inflate
from naiad.frontends.grpc.messages import Abort

INTERNAL, RESOURCE_EXHAUSTED, CANCELLED, UNIMPLEMENTED = 13, 8, 1, 12


def _status(fn) -> Abort:
    with pytest.raises(Abort) as info:
        fn()
    return info.value


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
def test_round_trip_and_read_only(encoding):
    data = bytes(range(256)) * 40_000
    packed = gzip.compress(data) if encoding == b"gzip" else zlib.compress(data)
    out = inflate(encoding, packed, len(data), max_ratio=0)  # (250:1: past the default ratio)
    assert bytes(out) == data and out.readonly


def test_message_limit_stops_inflating_early():
    packed = gzip.compress(bytes(64 << 20))
    exc = _status(lambda: inflate(b"gzip", packed, 1 << 20, max_ratio=0))
    assert exc.code == RESOURCE_EXHAUSTED and "larger than max" in exc.details
    assert exc.inflated <= (1 << 20) + (1 << 20)  # stopped within one step of the limit


def test_ratio_limit_applies_past_the_floor_only():
    small = gzip.compress(bytes(RATIO_FLOOR))  # 1000:1, but not past the floor
    assert len(inflate(b"gzip", small, 1 << 30, max_ratio=10)) == RATIO_FLOOR
    big = gzip.compress(bytes(64 << 20))
    exc = _status(lambda: inflate(b"gzip", big, 1 << 30, max_ratio=100))
    assert exc.code == RESOURCE_EXHAUSTED and "100 times" in exc.details
    assert len(inflate(b"gzip", big, 1 << 30, max_ratio=0)) == 64 << 20  # 0: no ratio limit


def test_undecodable_truncated_and_unknown_encodings():
    assert _status(lambda: inflate(b"gzip", b"not gzip at all", 1 << 20)).code == INTERNAL
    packed = gzip.compress(b"x" * 100_000)
    assert "truncated" in _status(lambda: inflate(b"gzip", packed[:-20], 1 << 20)).details
    assert _status(lambda: inflate(b"br", packed, 1 << 20)).code == UNIMPLEMENTED


def test_cancelled_call_stops_inflating():
    packed = gzip.compress(bytes(8 << 20))
    assert _status(lambda: inflate(b"gzip", packed, 1 << 30, 0, cancelled=lambda: True)).code == CANCELLED


def test_zeros_are_refused_at_once_not_walked():
    """A message of zeros (field number 0) is protobuf's DecodeError without a Python walk over it."""
    start = time.perf_counter()
    with pytest.raises(DecodeError):
        wire.SplitInferRequest.FromString(memoryview(bytes(64 << 20)))
    assert time.perf_counter() - start < 0.5
