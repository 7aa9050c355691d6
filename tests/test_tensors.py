"""Datatype conversions of `naiad.tensors`: KServe, config and numpy names, the binary and BYTES wire forms, and
JSON `data`, each checked on its own (the HTTP and gRPC tests reach them only through whole requests)."""

from __future__ import annotations

import numpy as np
import pytest

from naiad import tensors
from naiad.errors import InvalidArgument

FIXED = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
]


@pytest.mark.parametrize("datatype", [*FIXED, "BF16"])
def test_config_and_wire_names_map_both_ways(datatype):
    config = tensors.wire_to_config(datatype)
    assert config == f"TYPE_{datatype}"
    assert tensors.config_to_wire(config) == datatype


def test_strings_are_bytes_on_the_wire_and_type_string_in_the_config():
    assert tensors.config_to_wire("TYPE_STRING") == "BYTES"
    assert tensors.wire_to_config("BYTES") == "TYPE_STRING"


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        (tensors.config_to_wire, "TYPE_FP128"),
        (tensors.wire_to_config, "FP128"),
        (tensors.numpy_dtype, "FP128"),
    ],
)
def test_unknown_names_are_invalid_arguments(call, arg):
    with pytest.raises(InvalidArgument, match="FP128"):
        call(arg)


@pytest.mark.parametrize("datatype", FIXED)
def test_numpy_dtypes_name_their_datatype(datatype):
    dtype = tensors.numpy_dtype(datatype)
    assert tensors.datatype_of(np.zeros(2, dtype=dtype)) == datatype
    assert tensors.ITEMSIZE[datatype] == dtype.itemsize


def test_bf16_is_uint16_words_told_apart_by_the_hint():
    words = np.array([0x3F80], dtype=np.uint16)  # 1.0 in bfloat16
    assert tensors.numpy_dtype("BF16") == np.uint16
    assert tensors.datatype_of(words) == "UINT16"
    assert tensors.datatype_of(words, hint="BF16") == "BF16"
    assert tensors.datatype_of(np.zeros(1, np.float32), hint="BF16") == "FP32"  # the hint is for uint16 only


@pytest.mark.parametrize("array", [np.array([b"a"]), np.array(["a"]), np.array([b"a"], dtype=object)])
def test_bytes_str_and_object_arrays_are_bytes(array):
    assert tensors.datatype_of(array) == "BYTES"


def test_an_unsupported_numpy_dtype_is_refused():
    with pytest.raises(InvalidArgument, match="unsupported numpy dtype complex64"):
        tensors.datatype_of(np.zeros(1, np.complex64))


def test_element_count_is_the_product_of_the_shape():
    assert tensors.element_count([2, 3, 4]) == 24
    assert tensors.element_count([]) == 1
    assert tensors.element_count([5, 0]) == 0


# ---- binary tensor data ----


@pytest.mark.parametrize("datatype", FIXED)
def test_fixed_size_tensors_round_trip_through_wire_bytes(datatype):
    dtype = tensors.numpy_dtype(datatype)
    array = (np.arange(6) % 2).astype(dtype).reshape(2, 3)
    wire = bytes(tensors.to_bytes(array, datatype))
    assert len(wire) == 6 * dtype.itemsize
    back = tensors.from_buffer(datatype, wire, [2, 3])
    assert back.dtype == dtype and back.shape == (2, 3)
    np.testing.assert_array_equal(back, array)


def test_wire_bytes_are_little_endian_and_c_ordered():
    big = np.array([1, 2], dtype=">i4")
    assert bytes(tensors.to_bytes(big, "INT32")) == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    columns = np.arange(6, dtype=np.int8).reshape(2, 3).T  # not C-contiguous
    assert bytes(tensors.to_bytes(columns, "INT8")) == bytes([0, 3, 1, 4, 2, 5])
    assert bytes(tensors.to_bytes(np.zeros((0, 3), np.float32), "FP32")) == b""


def test_a_buffer_of_the_wrong_size_is_refused_with_both_sizes():
    with pytest.raises(InvalidArgument, match="unexpected total byte size 7 for input, expecting 8"):
        tensors.from_buffer("FP32", b"\x00" * 7, [2])


# ---- BYTES: 4-byte little-endian length, then the bytes ----


def test_bytes_elements_are_length_prefixed():
    array = np.array([b"ab", "\u00e9", 7], dtype=object)
    wire = tensors.serialize_bytes(array)
    assert wire == b"\x02\x00\x00\x00ab" + b"\x02\x00\x00\x00\xc3\xa9" + b"\x01\x00\x00\x007"
    back = tensors.deserialize_bytes(wire, 3)
    assert back.dtype == object and list(back) == [b"ab", "\u00e9".encode(), b"7"]
    assert list(tensors.from_buffer("BYTES", wire, [3, 1]).reshape(-1)) == list(back)
    assert bytes(tensors.to_bytes(back, "BYTES")) == wire


@pytest.mark.parametrize(
    ("wire", "count", "message"),
    [
        (b"\x02\x00", None, "incomplete 4-byte length prefix"),
        (b"\x05\x00\x00\x00abc", None, "element of length 5 runs past the end"),
        (b"\x01\x00\x00\x00a", 2, "expected 2 BYTES elements, got 1"),
    ],
)
def test_malformed_bytes_data_is_refused(wire, count, message):
    with pytest.raises(InvalidArgument, match=message):
        tensors.deserialize_bytes(wire, count)


# ---- JSON data ----


def test_json_data_may_be_flat_or_nested():
    flat = tensors.from_json_data("FP32", [1, 2, 3, 4], [2, 2])
    nested = tensors.from_json_data("FP32", [[1, 2], [3, 4]], [2, 2])
    assert flat.dtype == np.float32 and flat.shape == (2, 2)
    np.testing.assert_array_equal(flat, nested)
    assert tensors.to_json_data(nested, "FP32") == [1.0, 2.0, 3.0, 4.0]


def test_json_integers_past_two_to_the_63_stay_exact():
    big = 2**64 - 1
    array = tensors.from_json_data("UINT64", [big, 1], [2])
    assert (
        array.dtype == np.uint64
        and int(array[0]) == big
        and tensors.to_json_data(array, "UINT64") == [big, 1]
    )


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("INT8", [200], "value out of range for INT8"),
        ("UINT8", [-1], "value out of range for UINT8"),
        ("UINT64", [2**64, 1], "value out of range for UINT64"),
        ("INT32", [1.5], "INT32 tensor data must be JSON integers"),
        ("INT32", [1, True], "INT32 tensor data must be JSON integers"),
        ("FP32", ["1.0"], "FP32 tensor data must be JSON numbers"),
        ("BOOL", [1], "BOOL tensor data must be true/false"),
        ("BYTES", [1], "BYTES tensor data must be strings, got int"),
        ("BF16", [1.0], "BF16 tensors can only be sent with the binary tensor data extension"),
    ],
)
def test_json_data_of_the_wrong_kind_is_refused(datatype, data, message):
    with pytest.raises(InvalidArgument, match=message):
        tensors.from_json_data(datatype, data, [len(data)])


@pytest.mark.parametrize("datatype", ["FP32", "BYTES"])
def test_json_data_must_fill_the_shape(datatype):
    data = [1.0, 2.0, 3.0] if datatype == "FP32" else ["a", "b", "c"]
    with pytest.raises(InvalidArgument, match=r"unexpected number of elements 3 in 'data', expecting 4"):
        tensors.from_json_data(datatype, data, [2, 2])


def test_json_bool_and_bytes_tensors():
    flags = tensors.from_json_data("BOOL", [True, False], [2])
    assert flags.dtype == np.bool_ and tensors.to_json_data(flags, "BOOL") == [True, False]
    strings = tensors.from_json_data("BYTES", [["a", "\u00e9"]], [1, 2])
    assert strings.shape == (1, 2) and list(strings.reshape(-1)) == [b"a", "\u00e9".encode()]
    assert tensors.to_json_data(strings, "BYTES") == ["a", "\u00e9"]


def test_an_empty_json_tensor_has_the_shape_and_dtype():
    empty = tensors.from_json_data("INT16", [], [0, 3])
    assert empty.shape == (0, 3) and empty.dtype == np.int16


def test_outputs_json_cannot_carry_are_refused():
    with pytest.raises(InvalidArgument, match="not valid UTF-8; request it with binary_data: true"):
        tensors.to_json_data(np.array([b"\xff"], dtype=object), "BYTES")
    with pytest.raises(InvalidArgument, match="BF16 outputs can only be returned with the binary"):
        tensors.to_json_data(np.zeros(1, np.uint16), "BF16")
