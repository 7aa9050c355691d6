"""ModelInfer on the wire without copying tensor bytes: raw contents stay views of the received/sent buffers."""

from __future__ import annotations

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from .messages import WireMessage

# Below this size a message is parsed and serialized by protobuf as a whole: the copies cost less than the scan.
SPLIT_MIN = 16384
# The most top-level fields a ModelInferRequest may have (inputs, outputs, parameters, raw contents and its few
# scalars: a model's handful of tensors need a handful). Past it the message is refused before protobuf sees it:
# 16 MiB of empty `inputs` (8 million) held the event loop 0.6-1.4 s in protobuf's parse (which holds the GIL: a
# thread would not help) and took 45x the message's size in memory (+730 MiB; at 2 GiB, ~90 GB).
MAX_SPLIT_FIELDS = 65536
_RAW_INPUT_KEY = 7 << 3 | 2  # ModelInferRequest.raw_input_contents, length-delimited
_INPUT_KEY = 5 << 3 | 2  # ModelInferRequest.inputs
_INPUT_HEAD = bytes([_INPUT_KEY])
_TENSOR_DATATYPE = 2  # InferInputTensor.datatype
_TENSOR_CONTENTS = 5  # InferInputTensor.contents
# InferTensorContents' fixed-width fields, whose packed form is the array itself (little-endian), by the datatype
# they carry: a large one is cut out of the message as raw contents are (field numbers from the protos). Not BOOL:
# a bool is a varint, which a client may write in more than one byte or as any non-zero value.
CONTENTS_FIELDS = {f.name: f.number for f in pb.InferTensorContents.DESCRIPTOR.fields}
PACKED_CONTENTS = {b"FP32": CONTENTS_FIELDS["fp32_contents"], b"FP64": CONTENTS_FIELDS["fp64_contents"]}
PACKED_SPLIT_MIN = 4096  # bytes of an input (its contents with it) before its contents are cut out
_RAW_OUTPUT_KEY = bytes([6 << 3 | 2])  # ModelInferResponse.raw_output_contents, length-delimited
_INFER_RESPONSE_KEY = bytes([2 << 3 | 2])  # ModelStreamInferResponse.infer_response, length-delimited


def _varint(view, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end:
        b = view[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            break
    raise ValueError("bad varint")


def _payload(view, pos: int, end: int) -> tuple[int, int]:
    """Where a length-delimited field's payload starts and ends, its length's varint starting at `pos`."""
    length, pos = _varint(view, pos, end)
    if pos + length > end:
        raise ValueError("truncated field")
    return pos, pos + length


def _skip(view, pos: int, end: int, wire: int) -> int:
    """Past a field's value of wire type 0 (varint), 1 (fixed64) or 5 (fixed32); ValueError for any other."""
    if wire == 0:
        return _varint(view, pos, end)[1]
    if wire == 1:
        return pos + 8
    if wire == 5:
        return pos + 4
    raise ValueError("group or unknown wire type")


def _split(view) -> tuple[list, list, dict]:
    """The top-level fields of a serialized ModelInferRequest: (spans of the other fields, raw_input_contents
    payloads, large packed typed contents by input position), all memoryviews of `view` but the new heads of the
    inputs whose contents were cut out. ValueError where the wire format is not one it can walk: protobuf
    then parses or refuses it in C. A field number 0 is protobuf's DecodeError at once: 512 MiB of zeros are
    268 million two-byte "fields", minutes of the event loop had this loop walked them. More than
    MAX_SPLIT_FIELDS fields is a DecodeError too, after at most that many steps."""
    n = len(view)
    pos = start = 0
    keep, raw = [], []
    packed: dict[int, memoryview] = {}
    fields = inputs = 0
    while pos < n:
        field_start = pos
        key, pos = _varint(view, pos, n)
        if key < 8:  # field number 0: protobuf refuses it too, but only after copying the whole message
            raise DecodeError(
                f"Error parsing message with type '{pb.ModelInferRequest.DESCRIPTOR.full_name}'"
            )
        fields += 1
        if fields > MAX_SPLIT_FIELDS:
            raise DecodeError(
                f"{pb.ModelInferRequest.DESCRIPTOR.full_name} has more than {MAX_SPLIT_FIELDS} top-level fields "
                "(inputs, outputs, parameters, raw_input_contents)"
            )
        wire = key & 7
        if wire == 2:
            pos, end = _payload(view, pos, n)
            if key == _RAW_INPUT_KEY:
                if start < field_start:
                    keep.append(view[start:field_start])
                raw.append(view[pos:end])
                start = end
            elif key == _INPUT_KEY:
                cut = _packed_contents(view, pos, end) if end - pos >= PACKED_SPLIT_MIN else None
                if cut is not None:  # the input goes on without its contents field
                    cstart, cend, values = cut
                    if start < field_start:
                        keep.append(view[start:field_start])
                    keep += [
                        _field_head(_INPUT_HEAD, end - pos - (cend - cstart)),
                        view[pos:cstart],
                        view[cend:end],
                    ]
                    packed[inputs] = values
                    start = end
                inputs += 1
            pos = end
        else:
            pos = _skip(view, pos, n, wire)
    if pos != n:
        raise ValueError("truncated field")
    if start < n:
        keep.append(view[start:n])
    return keep, raw, packed


def _packed_contents(view, pos: int, end: int) -> tuple[int, int, memoryview] | None:
    """In the InferInputTensor at view[pos:end]: where its `contents` field starts and ends and the values of its one
    field, when that is the packed fixed-width field of the input's datatype (PACKED_CONTENTS) and `contents`
    occurs once; None for anything else (protobuf parses it); ValueError where the input cannot be walked (protobuf
    judges the whole message)."""
    datatype = b""  # (none seen: no datatype is empty)
    contents: tuple[int, int, int] | None = None
    while pos < end:
        field_start = pos
        key, pos = _varint(view, pos, end)
        wire = key & 7
        if wire == 2:
            pos, field_end = _payload(view, pos, end)
            if key >> 3 == _TENSOR_DATATYPE:
                datatype = bytes(view[pos:field_end])  # (the last one counts, as in protobuf)
            elif key >> 3 == _TENSOR_CONTENTS:
                if contents is not None:
                    return None  # protobuf merges the two
                contents = (field_start, field_end, pos)
            pos = field_end
        else:
            pos = _skip(view, pos, end, wire)
    number = PACKED_CONTENTS.get(datatype)
    if pos != end or contents is None or number is None:
        return None
    field_start, field_end, pos = contents
    key, pos = _varint(view, pos, field_end)
    if key != number << 3 | 2:
        return None
    length, pos = _varint(view, pos, field_end)
    if pos + length != field_end:
        return None  # another field of the contents, or a truncated one
    return field_start, field_end, view[pos:field_end]


def packed_field(data: bytes, number: int) -> memoryview | None:
    """The payload of field `number` of a serialized message when it occurs once and length-delimited (a packed
    repeated scalar: its values end to end, little-endian); None otherwise, or where `data` cannot be walked."""
    view = memoryview(data)
    n = len(view)
    pos = 0
    found = None
    try:
        while pos < n:
            key, pos = _varint(view, pos, n)
            wire = key & 7
            if wire == 2:
                pos, end = _payload(view, pos, n)
                if key >> 3 == number:
                    if found is not None:
                        return None
                    found = view[pos:end]
                pos = end
            elif key >> 3 == number:
                return None  # (an unpacked encoding)
            else:
                pos = _skip(view, pos, n, wire)
    except ValueError:
        return None
    return found if pos == n else None


class SplitInferRequest:
    """A ModelInferRequest whose raw_input_contents are memoryviews of the received message (no copies):
    numpy arrays made from them are views of the bytes that came off the socket."""

    __slots__ = ("message", "packed", "raw")

    def __init__(self, message, raw, packed=None):
        self.message = message
        self.raw = raw  # None: the message's own raw_input_contents
        self.packed = packed  # {input position: its contents' values} cut out of the message

    @classmethod
    def FromString(cls, data):  # protobuf's name: server.py calls request_type.FromString
        if len(data) >= SPLIT_MIN:
            view = memoryview(data)
            try:
                keep, raw, packed = _split(view)
            except ValueError:
                pass  # protobuf itself says what is wrong with it (or parses it)
            else:
                if raw or packed:
                    rest = keep[0] if len(keep) == 1 else b"".join(keep)
                    return cls(pb.ModelInferRequest.FromString(rest), raw, packed or None)
        return cls(pb.ModelInferRequest.FromString(data), None)


class ChunkedResponse(WireMessage):
    """A ModelInferResponse serialized as buffers to send in order: the message without its
    raw_output_contents, then each raw entry's field key and length followed by the tensor's own memory."""

    __slots__ = ("message", "raw")

    def __init__(self, message, raw: list):
        self.message = message
        self.raw = raw

    def wire_chunks(self) -> list:
        out = [self.message.SerializeToString()]
        for buf in self.raw:
            out.append(_field_head(_RAW_OUTPUT_KEY, len(buf)))
            if len(buf):
                out.append(buf)
        return out

    def SerializeToString(self) -> bytes:  # protobuf's name
        return b"".join(self.wire_chunks())


class ChunkedStreamResponse(WireMessage):
    """A ModelStreamInferResponse whose infer_response is a ChunkedResponse: the field's key and length, then
    the response's buffers (the output tensors' own memory)."""

    __slots__ = ("response",)

    def __init__(self, response: ChunkedResponse):
        self.response = response

    def wire_chunks(self) -> list:
        inner = self.response.wire_chunks()
        return [_field_head(_INFER_RESPONSE_KEY, sum(len(c) for c in inner)), *inner]

    def SerializeToString(self) -> bytes:  # protobuf's name
        return b"".join(self.wire_chunks())


def stream_response(response) -> pb.ModelStreamInferResponse | ChunkedStreamResponse:
    """ModelStreamInfer's message for an encoded response (a ModelInferResponse or a ChunkedResponse)."""
    if type(response) is ChunkedResponse:
        return ChunkedStreamResponse(response)
    return pb.ModelStreamInferResponse(infer_response=response)


def _field_head(key: bytes, n: int) -> bytes:
    """A length-delimited field's key and the varint of its length `n`."""
    head = bytearray(key)
    while n >= 0x80:
        head.append(n & 0x7F | 0x80)
        n >>= 7
    head.append(n)
    return bytes(head)
