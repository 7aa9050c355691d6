"""What crosses between a frontend worker and the engine: tensors inline or in a slab, read in place, and the
slab released only when the last view of it is gone."""

from __future__ import annotations

import gc
import os

import numpy as np

from naiad.engine import wire
from naiad.engine.slabs import SlabMaps, SlabPool
from naiad.inference import InferenceRequest, InferenceResponse, OutputTensor, RequestedOutput


def test_request_round_trip_inline_and_in_a_slab():
    pool = SlabPool(f"naiad-test{os.getpid()}")
    maps = SlabMaps()
    try:
        small = np.arange(16, dtype=np.float32).reshape(1, 16)
        big = np.random.default_rng(0).random((2, 40000)).astype(np.float64)  # 640 KB: a slab
        text = np.array([b"a", b"bc", b""], dtype=np.object_)
        req = InferenceRequest(
            "m",
            {"SMALL": small, "BIG": big, "TEXT": text},
            {"SMALL": "FP32", "BIG": "FP64", "TEXT": "BYTES"},
            model_version=2,
            id="r1",
            outputs=[RequestedOutput("OUT", True, 0, {"shared_memory_region": "x"})],
            parameters={"sequence_id": 7},
            correlation_id=7,
            flags=1,
        )
        msg = wire.encoder.encode(wire.Infer(1, wire.encode_request(req, pool)))
        decoded = wire.decoder.decode(msg)
        released = []
        got = wire.decode_request(decoded.request, maps, released.append)
        assert decoded.request.slab and decoded.request.inputs[0].data is not None
        np.testing.assert_array_equal(got.inputs["SMALL"], small)
        np.testing.assert_array_equal(got.inputs["BIG"], big)
        assert list(got.inputs["TEXT"]) == [b"a", b"bc", b""]
        assert got.datatypes == req.datatypes and got.model_version == 2 and got.correlation_id == 7
        assert got.outputs[0].parameters == {"shared_memory_region": "x"}
        view = got.inputs["BIG"][1, 10:20]  # a view of a view keeps the slab
        del got
        gc.collect()
        assert released == []
        del view
        gc.collect()
        assert released == [decoded.request.slab]
    finally:
        pool.close()


def test_response_error_and_outputs():
    pool = SlabPool(f"naiad-test{os.getpid()}r")
    try:
        out = np.ones((3, 50000), np.int32)
        resp = InferenceResponse("m", "1", [OutputTensor("OUT", "INT32", out)], id="x", final=False)
        got = wire.decode_response(wire.encode_response(resp, pool), SlabMaps(), lambda _: None)
        np.testing.assert_array_equal(got.outputs[0].data, out)
        assert not got.final and got.id == "x"
        failed = InferenceResponse("m", "1", error=ValueError("bad input"))
        err = wire.decode_response(wire.encode_response(failed, pool), SlabMaps(), lambda _: None).error
        assert type(err).__name__ == "InvalidArgument" and "bad input" in str(err)
    finally:
        pool.close()
