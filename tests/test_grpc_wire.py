"""grpc_wire: ModelInfer raw contents kept out of protobuf's copies parse and serialize as protobuf does."""

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from naiad.frontends import grpc_wire


def _request(raws):
    req = pb.ModelInferRequest(model_name="m", model_version="1", id="x")
    req.parameters["priority"].int64_param = 3
    for i, raw in enumerate(raws):
        t = req.inputs.add(name=f"IN{i}", datatype="FP32", shape=[len(raw) // 4])
        t.parameters["k"].string_param = "v"
        req.raw_input_contents.append(raw)
    req.outputs.add(name="OUT0")
    return req


def test_split_request_matches_protobuf_and_views_the_buffer():
    raws = [np.arange(20000, dtype=np.float32).tobytes(), b"\x01\x02\x03\x04", b""]
    wire = _request(raws).SerializeToString()
    # an unknown varint and fixed32 field after the raw contents: protobuf keeps them, so must the split
    wire += bytes([15 << 3 | 0, 0x96, 0x01, (16 << 3 | 5) & 0x7F | 0x80, 1, 1, 2, 3, 4])
    buf = memoryview(wire)
    got = grpc_wire.SplitInferRequest.FromString(buf)
    assert got.raw is not None and [bytes(r) for r in got.raw] == raws
    assert all(isinstance(r, memoryview) and r.obj is wire for r in got.raw)  # views, not copies
    expected = pb.ModelInferRequest.FromString(wire)
    del expected.raw_input_contents[:]
    assert got.message == expected


def test_small_request_is_parsed_whole():
    got = grpc_wire.SplitInferRequest.FromString(_request([b"abcd"]).SerializeToString())
    assert got.raw is None and list(got.message.raw_input_contents) == [b"abcd"]


@pytest.mark.parametrize(
    "wire",
    [
        b"\x3a\xff\xff\x03" + b"x" * 20000,  # a raw entry longer than the message
        b"\x0b" + b"x" * 20000,  # a group start (wire type 3)
        b"\x3a" + b"\xff" * 20000,  # a varint that never ends
    ],
)
def test_malformed_request_gets_protobufs_error(wire):
    with pytest.raises(DecodeError):
        grpc_wire.SplitInferRequest.FromString(wire)


def test_chunked_response_serializes_as_protobuf():
    out = pb.ModelInferResponse(model_name="m", model_version="1", id="x")
    out.outputs.add(name="OUT0", datatype="FP32", shape=[70000])
    out.outputs.add(name="OUT1", datatype="FP32", shape=[0])
    arr = np.linspace(0, 1, 70000, dtype=np.float32)
    raws = [memoryview(arr).cast("B"), b""]
    wire = grpc_wire.ChunkedResponse(out, raws).SerializeToString()
    expected = pb.ModelInferResponse()
    expected.CopyFrom(out)
    expected.raw_output_contents.extend([arr.tobytes(), b""])
    assert pb.ModelInferResponse.FromString(wire) == expected
