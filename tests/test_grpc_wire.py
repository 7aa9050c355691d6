"""grpc/wire.py: ModelInfer raw contents kept out of protobuf's copies parse and serialize as protobuf
does."""

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from naiad.frontends.grpc import codec, wire


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
    encoded = _request(raws).SerializeToString()
    # an unknown varint and fixed32 field after the raw contents: protobuf keeps them, so must the split
    encoded += bytes([15 << 3 | 0, 0x96, 0x01, (16 << 3 | 5) & 0x7F | 0x80, 1, 1, 2, 3, 4])
    buf = memoryview(encoded)
    got = wire.SplitInferRequest.FromString(buf)
    assert got.raw is not None and [bytes(r) for r in got.raw] == raws
    assert all(isinstance(r, memoryview) and r.obj is encoded for r in got.raw)  # views, not copies
    expected = pb.ModelInferRequest.FromString(encoded)
    del expected.raw_input_contents[:]
    assert got.message == expected


def test_small_request_is_parsed_whole():
    got = wire.SplitInferRequest.FromString(_request([b"abcd"]).SerializeToString())
    assert got.raw is None and list(got.message.raw_input_contents) == [b"abcd"]


@pytest.mark.parametrize(
    "encoded",
    [
        b"\x3a\xff\xff\x03" + b"x" * 20000,  # a raw entry longer than the message
        b"\x0b" + b"x" * 20000,  # a group start (wire type 3)
        b"\x3a" + b"\xff" * 20000,  # a varint that never ends
    ],
)
def test_malformed_request_gets_protobufs_error(encoded):
    with pytest.raises(DecodeError):
        wire.SplitInferRequest.FromString(encoded)


def test_chunked_response_serializes_as_protobuf():
    out = pb.ModelInferResponse(model_name="m", model_version="1", id="x")
    out.outputs.add(name="OUT0", datatype="FP32", shape=[70000])
    out.outputs.add(name="OUT1", datatype="FP32", shape=[0])
    arr = np.linspace(0, 1, 70000, dtype=np.float32)
    raws = [memoryview(arr).cast("B"), b""]
    encoded = wire.ChunkedResponse(out, raws).SerializeToString()
    expected = pb.ModelInferResponse()
    expected.CopyFrom(out)
    expected.raw_output_contents.extend([arr.tobytes(), b""])
    assert pb.ModelInferResponse.FromString(encoded) == expected


def test_chunked_stream_response_serializes_as_protobuf():
    """ModelStreamInfer's message around a chunked response: the same bytes protobuf writes for it."""
    out = pb.ModelInferResponse(model_name="m", model_version="1", id="x")
    out.parameters["triton_final_response"].bool_param = True
    out.outputs.add(name="OUT0", datatype="FP32", shape=[70000])
    arr = np.linspace(0, 1, 70000, dtype=np.float32)
    chunked = wire.stream_response(wire.ChunkedResponse(out, [memoryview(arr).cast("B")]))
    assert isinstance(chunked, wire.ChunkedStreamResponse)
    assert any(isinstance(c, memoryview) and c.obj is arr for c in chunked.wire_chunks())  # not a copy
    expected = pb.ModelInferResponse()
    expected.CopyFrom(out)
    expected.raw_output_contents.append(arr.tobytes())
    encoded = chunked.SerializeToString()
    assert encoded == pb.ModelStreamInferResponse(infer_response=expected).SerializeToString()
    assert wire.stream_response(out) == pb.ModelStreamInferResponse(infer_response=out)


def test_a_request_of_very_many_fields_is_refused_before_protobuf_parses_it():
    """Protobuf's parse of many small fields holds the GIL for seconds and takes 20x the message in memory: past
    MAX_SPLIT_FIELDS top-level fields the request is refused after that many steps of the walk."""
    head = pb.ModelInferRequest(model_name="m").SerializeToString()
    at_limit = head + b"\x2a\x00" * (wire.MAX_SPLIT_FIELDS - 1)  # model_name + empty `inputs`
    parsed = wire.SplitInferRequest.FromString(at_limit)
    assert len(parsed.message.inputs) == wire.MAX_SPLIT_FIELDS - 1
    with pytest.raises(DecodeError, match="more than 65536 top-level fields"):
        wire.SplitInferRequest.FromString(at_limit + b"\x2a\x00" * (4 << 20))  # 8 MiB more of them


def test_packed_field_is_the_values_end_to_end_or_none():
    contents = pb.InferTensorContents()
    contents.fp32_contents.extend([1.5, -2.0, 3.25])
    contents.int_contents.extend([7, 300])
    data = contents.SerializeToString()
    fp32 = pb.InferTensorContents.DESCRIPTOR.fields_by_name["fp32_contents"].number
    assert np.frombuffer(wire.packed_field(data, fp32), "<f4").tolist() == [1.5, -2.0, 3.25]
    assert wire.packed_field(data, 7) is None  # absent (fp64_contents)
    assert wire.packed_field(data + data, fp32) is None  # twice: protobuf would concatenate them
    unpacked = bytes([fp32 << 3 | 5]) + np.float32(1).tobytes()
    assert wire.packed_field(unpacked, fp32) is None
    assert wire.packed_field(data[:-1], fp32) is None  # truncated
    assert wire.packed_field(b"\xff" * 12, fp32) is None  # not a message


def test_large_typed_contents_are_read_from_their_packed_form():
    values = np.arange(codec.PACKED_MIN, dtype=np.float64) / 3
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="X", datatype="FP64", shape=[len(values)]).contents.fp64_contents.extend(
        values.tolist()
    )
    req.inputs.add(name="Y", datatype="FP64", shape=[2]).contents.fp64_contents.extend([1.0, 2.0])
    got = codec.decode_request(pb.ModelInferRequest.FromString(req.SerializeToString())).inputs
    np.testing.assert_array_equal(got["X"], values)
    assert not got["X"].flags.writeable  # a view of the serialized field, not protobuf's list converted
    assert got["Y"].tolist() == [1.0, 2.0] and got["Y"].flags.writeable  # small: through the list


def _typed_request(datatype="FP32", extra_int=False, twice=False):
    """A ModelInferRequest with a small and a large input in typed contents (FP32 values), serialized."""
    values = np.arange(5000, dtype=np.float32) / 7
    req = pb.ModelInferRequest(model_name="m", id="t")
    req.inputs.add(name="SMALL", datatype="FP32", shape=[2]).contents.fp32_contents.extend([1.0, 2.0])
    req.outputs.add(name="OUT")
    big = pb.ModelInferRequest.InferInputTensor(name="BIG", datatype=datatype, shape=[len(values)])
    big.parameters["k"].string_param = "v"
    big.contents.fp32_contents.extend(values.tolist())
    if extra_int:
        big.contents.int_contents.append(3)
    tensor = big.SerializeToString()
    if twice:  # its contents field once more: protobuf merges (concatenates) the two
        more = pb.InferTensorContents(fp32_contents=[9.0]).SerializeToString()
        tensor += wire._field_head(bytes([5 << 3 | 2]), len(more)) + more
    return req.SerializeToString() + wire._field_head(bytes([5 << 3 | 2]), len(tensor)) + tensor, values


def test_large_typed_contents_are_cut_out_as_views_of_the_message():
    encoded, values = _typed_request()
    got = wire.SplitInferRequest.FromString(encoded)
    assert got.raw == [] and list(got.packed) == [1] and got.packed[1].obj is encoded  # a view, not a copy
    assert not got.message.inputs[1].HasField("contents")
    full = pb.ModelInferRequest.FromString(encoded)
    full.inputs[1].ClearField("contents")
    assert got.message == full  # everything else as protobuf parses it
    req = codec.decode_request(got.message, None, got.raw, got.packed)
    np.testing.assert_array_equal(req.inputs["BIG"], values)
    assert req.inputs["BIG"].base is not None and req.inputs["SMALL"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    "kwargs",
    [{"extra_int": True}, {"datatype": "INT32"}, {"twice": True}],
    ids=["another-field", "other-datatype", "contents-twice"],
)
def test_typed_contents_protobuf_must_judge_are_left_in(kwargs):
    """Contents with a second field, under another datatype, or given twice stay in the message: decoding it gives
    what the whole message gives (Triton's error for a field of another type, or for a count the shape does not
    hold)."""
    encoded, _ = _typed_request(**kwargs)
    got = wire.SplitInferRequest.FromString(encoded)
    assert got.packed is None and got.message == pb.ModelInferRequest.FromString(encoded)
    expected = {
        "extra_int": "of type 'INT32', expected datatype 'FP32'",
        "datatype": "of type 'FP32', expected datatype 'INT32'",
        "twice": r"input byte size mismatch for input 'BIG' for model 'm'. Expected 20000, got 20004",
    }[next(iter(kwargs))]
    with pytest.raises(Exception, match=expected):
        codec.decode_request(got.message, None, got.raw, got.packed)


def test_cut_contents_with_raw_input_contents_are_refused_as_before():
    encoded, _ = _typed_request()
    encoded += bytes([7 << 3 | 2, 4]) + b"\0\0\0\0"  # a raw_input_contents entry too
    got = wire.SplitInferRequest.FromString(encoded)
    assert got.packed is not None and len(got.raw) == 1
    with pytest.raises(Exception, match="contents field must not be specified when using raw_input_contents"):
        codec.decode_request(got.message, None, got.raw, got.packed)


def test_bools_are_read_as_protobuf_reads_them():
    """A bool is a varint: a client may write 2 for true, or 1 in two bytes. Such contents stay in the message (no
    cut) and come out as protobuf reads them."""
    values = bytes([0, 1, 2]) * 3000 + b"\x81\x00"  # 9,000 one-byte bools, then a true in two bytes
    contents = wire._field_head(bytes([1 << 3 | 2]), len(values)) + values
    tensor = pb.ModelInferRequest.InferInputTensor(
        name="B", datatype="BOOL", shape=[9001]
    ).SerializeToString()
    tensor += wire._field_head(bytes([5 << 3 | 2]), len(contents)) + contents
    encoded = pb.ModelInferRequest(model_name="m").SerializeToString()
    encoded += wire._field_head(bytes([5 << 3 | 2]), len(tensor)) + tensor
    got = wire.SplitInferRequest.FromString(encoded)
    assert got.packed is None
    arr = codec.decode_request(got.message, None, got.raw, got.packed).inputs["B"]
    assert arr.dtype == np.bool_ and arr.tolist() == [False, True, True] * 3000 + [True]
