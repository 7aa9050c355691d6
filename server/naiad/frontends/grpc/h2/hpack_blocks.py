"""HPACK header blocks decoded in one loop over the block, on the `hpack` library's Decoder and tables.

The library decodes a field in several calls (a memoryview slice, an integer decoder, a tuple subclass, a debug
log call each): 18 µs for a grpcio block of nine fields with a new `grpc-timeout`, 3.3 µs here.
A block that repeats is answered from the reader's cache, but a client with a deadline sends a new one every call
(grpc core indexes each `grpc-timeout` value, so the dynamic table changes too). This decoder reads the same
representations (RFC 7541 section 6: indexed fields, literals with, without and never indexed, Huffman-coded
strings) with the library's static table, dynamic table and Huffman decoder, and raises the library's errors; a
block that opens with a dynamic table size update goes to the library whole. (bench/README.md, "gRPC calls with a
deadline".)"""

from __future__ import annotations

from typing import cast

import hpack
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

_STATIC = HeaderTable.STATIC_TABLE
_STATIC_LEN = len(_STATIC)
_VARINT_MAX = 5  # continuation octets of an integer, as the library allows (a uint32's worth)
# Huffman-coded strings seen lately, decoded: header names, and the values of the headers below (one process's
# cache is every client's, and any other value may be a credential); each at most _CACHED_LONGEST bytes coded
_DECODED: dict[bytes, bytes] = {}
_DECODED_MAX = 1024
_CACHED_LONGEST = 64
_SHARED_VALUES = frozenset(
    (b":path", b":authority", b":method", b":scheme", b"content-type", b"te", b"user-agent")
    + (b"grpc-accept-encoding", b"grpc-encoding", b"accept-encoding")
)


def decode(decoder: hpack.Decoder, block: bytes) -> list[tuple[bytes, bytes]]:
    """`decoder.decode(block, raw=True)`'s (name, value) pairs, its table updated as the library updates it."""
    table = decoder.header_table
    if (block and block[0] & 0xE0 == 0x20) or table.maxsize > decoder.max_allowed_table_size:
        # a table size update, or one owed: the library checks it. (It says it returns an Iterable of HeaderTuple, but
        # with raw=True what it returns is a list of (name, value) bytes pairs.)
        return cast("list[tuple[bytes, bytes]]", decoder.decode(block, raw=True))
    dynamic = table.dynamic_entries
    limit = decoder.max_header_list_size
    headers: list[tuple[bytes, bytes]] = []
    size = 0
    i, end = 0, len(block)
    try:
        while i < end:
            first = block[i]
            i += 1
            if first & 0x80:  # an indexed field
                index = first & 0x7F
                if index == 0x7F:
                    index, i = _integer(block, i, index)
                # (the static table inline: most indexed fields are in it, and a call costs more than the test)
                name, value = _STATIC[index - 1] if 0 < index <= _STATIC_LEN else _entry(dynamic, index)
            else:
                if first & 0x40:  # a literal the table keeps
                    prefix, keep = 0x3F, True
                elif first & 0x20:
                    raise hpack.HPACKDecodingError("Table size update not at the start of the block")
                else:  # a literal without indexing, or never indexed (0x10: sensitive)
                    prefix, keep = 0x0F, False
                index = first & prefix
                if index == prefix:
                    index, i = _integer(block, i, index)
                if index == 0:
                    name, i = _string(block, i, _DECODED)
                else:
                    name = _entry(dynamic, index)[0]
                shared = name in _SHARED_VALUES and not first & 0x10
                value, i = _string(block, i, _DECODED if shared else None)
                if keep:
                    table.add(name, value)
            headers.append((name, value))
            # field by field, as the library counts: a block of one-byte references to a 4 KB table entry
            # stops at the limit, not after thousands of fields
            size += len(name) + len(value) + 32
            if size > limit:
                raise hpack.OversizedHeaderListError(f"A header list larger than {limit} has been received")
    except IndexError as exc:  # the block ends inside a field
        raise hpack.HPACKDecodingError("Truncated header block") from exc
    return headers


def _entry(dynamic, index: int) -> tuple[bytes, bytes]:
    """The table entry at HPACK index `index`: the static table's, then the dynamic one's (0 is no index)."""
    if 0 < index <= _STATIC_LEN:
        return _STATIC[index - 1]
    at = index - _STATIC_LEN - 1
    if at >= 0:
        try:
            return dynamic[at]
        except IndexError:
            pass
    raise hpack.InvalidTableIndex(f"Invalid table index {index}")


def _integer(block: bytes, i: int, value: int) -> tuple[int, int]:
    """An integer whose prefix was full (`value`): its continuation octets from `i`; (the integer, where next)."""
    shift = 0
    for _ in range(_VARINT_MAX):
        octet = block[i]
        i += 1
        value += (octet & 0x7F) << shift
        if not octet & 0x80:
            return value, i
        shift += 7
    raise hpack.HPACKDecodingError("Variable integer representation is too long")


def _string(block: bytes, i: int, decoded: dict[bytes, bytes] | None) -> tuple[bytes, int]:
    """A string literal at `i`, Huffman-decoded when coded (through `decoded`, a cache, when given); (its bytes,
    where next)."""
    first = block[i]
    length = first & 0x7F
    i += 1
    if length == 0x7F:
        length, i = _integer(block, i, length)
    text = block[i : i + length]
    if len(text) != length:
        raise hpack.HPACKDecodingError("Truncated header block")
    if first & 0x80:
        if decoded is None:
            text = decode_huffman(text)
        else:
            cached = decoded.get(text)
            if cached is None:
                cached = decode_huffman(text)
                if length <= _CACHED_LONGEST:
                    if len(decoded) >= _DECODED_MAX:
                        decoded.clear()
                    decoded[text] = cached
            text = cached
    return text, i + length
