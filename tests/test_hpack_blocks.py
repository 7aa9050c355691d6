"""frontends/grpc/h2/hpack_blocks.decode against the `hpack` library's own Decoder: the same headers, the same
dynamic table after every block, and the same error class for every malformed block."""

from __future__ import annotations

import random

import hpack
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from naiad.frontends.grpc.h2 import hpack_blocks

HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
NAMES = [
    b":path",
    b":method",
    b"content-type",
    b"te",
    b"grpc-timeout",
    b"user-agent",
    b"x-custom",
    b"authorization",
]
VALUES = [
    b"/inference.GRPCInferenceService/ModelInfer",
    b"POST",
    b"application/grpc",
    b"trailers",
    b"",
    b"v" * 300,
]


def _pair(limit: int = 65536) -> tuple[hpack.Decoder, hpack.Decoder]:
    pair = hpack.Decoder(), hpack.Decoder()
    for d in pair:
        d.max_header_list_size = limit
    return pair


def _same(ours: hpack.Decoder, theirs: hpack.Decoder, block: bytes) -> object:
    """Both decode `block` alike: the same pairs or the same error, and the same table afterwards."""
    try:
        expected: object = [(bytes(n), bytes(v)) for n, v in theirs.decode(block, raw=True)]
    except hpack.HPACKError as exc:
        expected = type(exc)
    try:
        got: object = hpack_blocks.decode(ours, block)
    except hpack.HPACKError as exc:
        got = type(exc)
    assert got == expected, block.hex()
    if not isinstance(expected, type):
        assert list(ours.header_table.dynamic_entries) == list(theirs.header_table.dynamic_entries)
    return expected


def test_grpc_clients_blocks_with_a_new_deadline_each_call():
    """What grpcio sends (captured from tritonclient 2.x with client_timeout): nine fields, `grpc-timeout` a new
    literal the table keeps at every call, the other fields' dynamic indexes moving as it grows."""
    first = bytes.fromhex(
        "40053a706174682a2f696e666572656e63652e47525043496e666572656e6365536572766963652f4d6f64656c496e666572400a"
        "3a617574686f726974790f3132372e302e302e313a35323733318386400c636f6e74656e742d74797065106170706c6963617469"
        "6f6e2f677270634002746508747261696c6572734014677270632d6163636570742d656e636f64696e67176964656e746974792c"
        "206465666c6174652c20677a6970400c677270632d74696d656f7574043439396d400a757365722d6167656e7430677270632d70"
        "7974686f6e2f312e38352e3320677270632d632f35382e302e3020286c696e75783b2063687474703229"
    )
    second = bytes.fromhex("c4c38386c2c1c0400c677270632d74696d656f7574043530316dbf")
    ours, theirs = _pair()
    _same(ours, theirs, first)
    _same(ours, theirs, second)
    assert dict(hpack_blocks.decode(hpack.Decoder(), first))[b"grpc-timeout"] == b"499m"


@pytest.mark.parametrize("huffman", [False, True])
def test_encoded_blocks_decode_as_the_library_decodes_them(huffman):
    rng = random.Random(7)
    encoder = hpack.Encoder()
    ours, theirs = _pair()
    for _ in range(300):
        headers = []
        for _ in range(rng.randint(1, 12)):
            name, value = rng.choice(NAMES), rng.choice(VALUES) + str(rng.randint(0, 20)).encode()
            kind = rng.random()
            if kind < 0.2:
                headers.append(hpack.NeverIndexedHeaderTuple(name, value))
            elif kind < 0.4:
                headers.append(hpack.HeaderTuple(name, value))  # (indexable: kept by the table)
            else:
                headers.append((name, value))
        if rng.random() < 0.05:
            encoder.header_table_size = rng.choice([0, 256, 4096])  # a size update opens the next block
        _same(ours, theirs, encoder.encode(headers, huffman=huffman))


def _literal(name: bytes, value: bytes, first: int = 0x00, huffman: bool = False) -> bytes:
    def string(s: bytes) -> bytes:
        coded = HUFFMAN.encode(s) if huffman else s
        assert len(coded) < 127
        return bytes([(0x80 if huffman else 0) | len(coded)]) + coded

    return bytes([first]) + string(name) + string(value)


@pytest.mark.parametrize(
    "block",
    [
        b"\x80",  # index 0
        b"\xbe",  # index 62: past an empty dynamic table
        b"\xff\x80\x80\x80\x80\x80\x01",  # an integer of six continuation octets
        b"\xff",  # an integer cut short
        b"\x0f\x80",  # a literal name index cut short
        b"\x00\x05ab",  # a name shorter than its length
        b"\x00\x01a\x05ab",  # a value shorter than its length
        b"\x7f\x10\x00",  # a literal whose name index is past the tables
        b"\x82\x3f\xe1\x1f",  # a table size update after a field
        b"\x82\x00\x81\xff\x81\xff",  # Huffman strings whose padding is not the EOS prefix
        b"\x3f\xe1\x3f",  # a table size update past the allowed size
        _literal(b"x-a", b"b", 0x40) + b"\xbf",  # index 63: past the one entry kept
    ],
)
def test_malformed_blocks_raise_what_the_library_raises(block):
    assert issubclass(_same(*_pair(), block), hpack.HPACKError)  # type: ignore[arg-type]


def test_index_0_is_refused_with_a_full_dynamic_table():
    ours, theirs = _pair()
    block = b"".join(_literal(b"x-%d" % i, b"v", 0x40) for i in range(70))
    _same(ours, theirs, block)
    assert len(ours.header_table.dynamic_entries) == 70
    assert _same(ours, theirs, b"\x80") is hpack.InvalidTableIndex


def test_references_to_a_large_entry_stop_at_the_limit(monkeypatch):
    """16k one-byte references to a 4 KB entry: refused after the field that crosses the limit, not at the end."""
    ours, theirs = _pair(limit=16384)
    _same(ours, theirs, _literal(b"x-a", b"", 0x40)[:-1] + b"\x7f\xa1\x1e" + b"v" * 4000)
    read = []
    monkeypatch.setattr(hpack_blocks, "_entry", lambda dynamic, index: read.append(index) or dynamic[0])
    with pytest.raises(hpack.OversizedHeaderListError):
        hpack_blocks.decode(ours, b"\xbe" * 16384)
    assert len(read) == 5


def test_a_header_list_over_the_limit_is_refused():
    block = b"".join(_literal(b"x-h%d" % i, b"v" * 40) for i in range(20))
    ours, theirs = _pair(limit=1000)
    _same(ours, theirs, block)
    with pytest.raises(hpack.OversizedHeaderListError):
        hpack_blocks.decode(ours, block)


def test_a_table_emptied_by_an_entry_larger_than_it():
    ours, theirs = _pair()
    for d in (ours, theirs):
        d.header_table_size = 100
    _same(ours, theirs, _literal(b"x-a", b"b", 0x40) + _literal(b"x-big", b"v" * 100, 0x40) + b"\x82")
    assert not ours.header_table.dynamic_entries


def test_only_names_and_well_known_values_are_kept_decoded_across_connections():
    """The process's cache of Huffman-decoded strings is every client's: header names, and the values of a few
    well-known headers unless sent as never indexed; never another value (a bearer token decoded for one client
    stays out of it)."""
    hpack_blocks._DECODED.clear()
    block = (
        _literal(b"authorization", b"Bearer s3cr3t-t0ken", 0x00, huffman=True)
        + _literal(b"user-agent", b"grpc-go/1.70", 0x40, huffman=True)
        + _literal(b"content-type", b"application/grpc+secret", 0x10, huffman=True)
    )
    assert hpack_blocks.decode(hpack.Decoder(), block) == [
        (b"authorization", b"Bearer s3cr3t-t0ken"),
        (b"user-agent", b"grpc-go/1.70"),
        (b"content-type", b"application/grpc+secret"),
    ]
    kept = set(hpack_blocks._DECODED.values())
    assert kept == {b"authorization", b"user-agent", b"content-type", b"grpc-go/1.70"}
