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


def test_chunked_stream_response_serializes_as_protobuf():
    """ModelStreamInfer's message around a chunked response: the same bytes protobuf writes for it."""
    out = pb.ModelInferResponse(model_name="m", model_version="1", id="x")
    out.parameters["triton_final_response"].bool_param = True
    out.outputs.add(name="OUT0", datatype="FP32", shape=[70000])
    arr = np.linspace(0, 1, 70000, dtype=np.float32)
    chunked = grpc_wire.stream_response(grpc_wire.ChunkedResponse(out, [memoryview(arr).cast("B")]))
    assert isinstance(chunked, grpc_wire.ChunkedStreamResponse)
    assert any(isinstance(c, memoryview) and c.obj is arr for c in chunked.wire_chunks())  # not a copy
    expected = pb.ModelInferResponse()
    expected.CopyFrom(out)
    expected.raw_output_contents.append(arr.tobytes())
    wire = chunked.SerializeToString()
    assert wire == pb.ModelStreamInferResponse(infer_response=expected).SerializeToString()
    assert grpc_wire.stream_response(out) == pb.ModelStreamInferResponse(infer_response=out)


def test_a_request_of_very_many_fields_is_refused_before_protobuf_parses_it():
    """Protobuf's parse of many small fields holds the GIL for seconds and takes 20x the message in memory: past
    MAX_SPLIT_FIELDS top-level fields the request is refused after that many steps of the walk."""
    head = pb.ModelInferRequest(model_name="m").SerializeToString()
    at_limit = head + b"\x2a\x00" * (grpc_wire.MAX_SPLIT_FIELDS - 1)  # model_name + empty `inputs`
    parsed = grpc_wire.SplitInferRequest.FromString(at_limit)
    assert len(parsed.message.inputs) == grpc_wire.MAX_SPLIT_FIELDS - 1
    with pytest.raises(DecodeError, match="more than 65536 top-level fields"):
        grpc_wire.SplitInferRequest.FromString(at_limit + b"\x2a\x00" * (4 << 20))  # 8 MiB more of them
