"""ModelInfer on the wire without copying tensor bytes: raw contents stay views of the received/sent buffers."""

from __future__ import annotations

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from .h2grpc_messages import WireMessage

# Below this size a message is parsed and serialized by protobuf as a whole: the copies cost less than the scan.
SPLIT_MIN = 16384
# The most top-level fields a ModelInferRequest may have (inputs, outputs, parameters, raw contents and its few
# scalars: a model's handful of tensors need a handful). Past it the message is refused before protobuf sees it:
# 16 MiB of empty `inputs` (8 million) held the event loop 0.6-1.4 s in protobuf's parse (which holds the GIL: a
# thread would not help) and took 45x the message's size in memory (+730 MiB; at 2 GiB, ~90 GB).
MAX_SPLIT_FIELDS = 65536
_RAW_INPUT_KEY = 7 << 3 | 2  # ModelInferRequest.raw_input_contents, length-delimited
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


def _split(view) -> tuple[list, list]:
    """The top-level fields of a serialized ModelInferRequest: (spans of the other fields, raw_input_contents
    payloads), all memoryviews of `view`. ValueError where the wire format is not one it can walk: protobuf
    then parses or refuses it in C. A field number 0 is protobuf's DecodeError at once: 512 MiB of zeros are
    268 million two-byte "fields", minutes of the event loop had this loop walked them. More than
    MAX_SPLIT_FIELDS fields is a DecodeError too, after at most that many steps."""
    n = len(view)
    pos = start = 0
    keep, raw = [], []
    fields = 0
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
            length, pos = _varint(view, pos, n)
            end = pos + length
            if end > n:
                raise ValueError("truncated field")
            if key == _RAW_INPUT_KEY:
                if start < field_start:
                    keep.append(view[start:field_start])
                raw.append(view[pos:end])
                start = end
            pos = end
        elif wire == 0:
            _, pos = _varint(view, pos, n)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError("group or unknown wire type")
    if pos != n:
        raise ValueError("truncated field")
    if start < n:
        keep.append(view[start:n])
    return keep, raw


class SplitInferRequest:
    """A ModelInferRequest whose raw_input_contents are memoryviews of the received message (no copies):
    numpy arrays made from them are views of the bytes that came off the socket."""

    __slots__ = ("message", "raw")

    def __init__(self, message, raw):
        self.message = message
        self.raw = raw  # None: the message's own raw_input_contents

    @classmethod
    def FromString(cls, data):  # protobuf's name: h2grpc calls request_type.FromString
        if len(data) >= SPLIT_MIN:
            view = memoryview(data)
            try:
                keep, raw = _split(view)
            except ValueError:
                pass  # protobuf itself says what is wrong with it (or parses it)
            else:
                if raw:
                    rest = keep[0] if len(keep) == 1 else b"".join(keep)
                    return cls(pb.ModelInferRequest.FromString(rest), raw)
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
