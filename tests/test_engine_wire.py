"""What crosses between a frontend worker and the engine: tensors inline or in a slab, read in place, and the
slab released only when the last view of it is gone."""

from __future__ import annotations

import gc
import os

import numpy as np

from naiad.engine import slabs, wire
from naiad.engine.slabs import SHM_DIR, SlabMaps, SlabPool
from naiad.errors import TooManyRequests
from naiad.frontends.transport.receive_buffers import ReceivePool
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
            outputs=[
                RequestedOutput("OUT", True, 0, {"shared_memory_region": "x"}),
                RequestedOutput("CLASSES", None, 3, {"shared_memory_offset": np.int64(64)}),
                RequestedOutput("JSON", False),
            ],
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
        assert got.outputs == [  # every field of each requested output, a numpy scalar as a plain number
            RequestedOutput("OUT", True, 0, {"shared_memory_region": "x"}),
            RequestedOutput("CLASSES", None, 3, {"shared_memory_offset": 64}),
            RequestedOutput("JSON", False, 0, {}),
        ]
        assert type(got.outputs[1].parameters["shared_memory_offset"]) is int
        view = got.inputs["BIG"][1, 10:20]  # a view of a view keeps the slab
        del got
        gc.collect()
        assert released == []
        del view
        gc.collect()
        assert released == [decoded.request.slab]
    finally:
        pool.close()


def test_small_tensors_of_every_kind_ride_inline_exactly():
    """The inline path keeps each array's dtype (byte order included), shape and values, whatever its layout."""
    pool = SlabPool(f"naiad-test{os.getpid()}k")
    try:
        rng = np.random.default_rng(3)
        cases = {
            "BOOL": np.array([[True, False, True]]),
            "UINT8": np.arange(6, dtype=np.uint8).reshape(2, 3),
            "INT64": np.array([-(2**40), 5], dtype=np.int64),
            "FP16": rng.random((2, 2)).astype(np.float16),
            "BF16": np.array([0x3F80, 0x4000], dtype=np.uint16),  # raw bfloat16 words
            "FP32": rng.random((3, 4), dtype=np.float32).T,  # not contiguous
            "FP64": rng.random(3).astype(">f8"),  # big-endian
            "EMPTY": np.zeros((0, 4), np.float32),
            "SCALAR": np.array(2.5, np.float32),  # no dimensions
        }
        items = [(name, "FP32" if name in ("EMPTY", "SCALAR") else name, arr) for name, arr in cases.items()]
        described, slab = wire.pack_tensors(items, pool)
        assert slab == "" and all(t.data is not None for t in described)
        request = wire.Request("m", -1, "", described, [], {}, 0, 0, 0, 0, None)
        sent = wire.decoder.decode(wire.encoder.encode(wire.Infer(1, request)))
        got = wire.unpack_tensors(sent.request.inputs, "", SlabMaps(), print)
        for (name, datatype, arr), (got_name, got_type, got_arr) in zip(items, got, strict=True):
            assert (got_name, got_type) == (name, datatype)
            assert got_arr.dtype == arr.dtype and got_arr.shape == arr.shape, name
            np.testing.assert_array_equal(got_arr, arr)
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


def test_an_error_crosses_with_when_to_come_back():
    """A refusal that says when to retry (429 / UNAVAILABLE with Retry-After) says it after the hop too."""
    sent = wire.Error(5, *wire.error_of(TooManyRequests("model 'm' is loading", retry_after=7.0)))
    got = wire.decoder.decode(wire.encoder.encode(sent))
    err = wire.raise_error(got.kind, got.message, got.retry_after)
    assert type(err) is TooManyRequests and err.retry_after == 7.0 and err.message == "model 'm' is loading"
    plain = wire.decoder.decode(wire.encoder.encode(wire.Error(6, *wire.error_of(ValueError("x")))))
    assert wire.raise_error(plain.kind, plain.message, plain.retry_after).retry_after is None


def test_an_output_that_is_the_input_stays_in_the_request_slab():
    worker_pool = SlabPool(f"naiad-test{os.getpid()}w")
    engine_pool = SlabPool(f"naiad-test{os.getpid()}e")
    engine_maps, worker_maps = SlabMaps(), SlabMaps()
    try:
        data = np.arange(100000, dtype=np.float32)
        req = InferenceRequest("m", {"IN": data}, {"IN": "FP32"})
        desc = wire.encode_request(req, worker_pool)
        engine_freed: list = []
        got = wire.decode_request(desc, engine_maps, engine_freed.append)
        out = got.inputs["IN"][10:]  # the model answers with a view of its input
        resp = InferenceResponse("m", "1", [OutputTensor("OUT", "FP32", out)])
        reply = wire.encode_response(resp, engine_pool, engine_maps.view(desc.slab))
        assert reply.slab == "" and reply.outputs[0].peer and reply.outputs[0].offset == 40
        del got, out, resp
        gc.collect()
        assert engine_freed == [desc.slab]
        own = (desc.slab, worker_pool.retain(desc.slab), worker_pool.free)
        worker_pool.free(desc.slab)  # the engine's Free: the response's view still holds the slab
        back = wire.decode_response(reply, worker_maps, lambda _: None, own)
        np.testing.assert_array_equal(back.outputs[0].data, data[10:])
        assert worker_pool.alloc(desc.inputs[0].nbytes).name != desc.slab  # still in use
        del back
        gc.collect()
        assert worker_pool.alloc(desc.inputs[0].nbytes).name == desc.slab  # back in the pool
    finally:
        worker_pool.close()
        engine_pool.close()


def test_tensors_in_a_shared_receive_buffer_are_lent_not_copied():
    """A frontend worker's request body lands in a shared receive buffer: its tensors are described where they
    are (the engine maps the same memory), the buffer is reused only after the engine's Free and the last
    view, and one the receive pool lets go is unlinked and its mapping dropped from the engine's cache."""
    pool = SlabPool(f"naiad-test{os.getpid()}s")
    receive = ReceivePool(limit=8 << 20)
    receive.share(pool)
    maps = SlabMaps()
    try:
        buf = receive.take(3 << 20)
        body = memoryview(buf)[: 3 << 20].toreadonly()
        buf[1000:1400] = np.arange(100, dtype=np.float32).tobytes()
        buf[4096 : 4096 + (1 << 20)] = np.full(1 << 18, 7, np.float32).tobytes()
        small = np.frombuffer(body, np.float32, 100, 1000)
        big = np.frombuffer(body, np.float32, 1 << 18, 4096).reshape(2, -1)
        req = InferenceRequest("m", {"SMALL": small, "BIG": big}, {"SMALL": "FP32", "BIG": "FP32"})
        desc = wire.encode_request(req, pool)
        assert desc.slab.startswith(pool.prefix + "-r") and desc.inputs[1].offset == 4096
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(pool.prefix + "-") and "-r" not in n]
        released: list = []
        got = wire.decode_request(desc, maps, released.append)
        np.testing.assert_array_equal(got.inputs["BIG"], big)
        buf[4096:4100] = np.float32(9).tobytes()  # the engine's view is the same memory
        assert got.inputs["BIG"][0, 0] == 9
        buf_id = id(buf)
        del req, small, big, body, buf
        assert id(receive.take(3 << 20)) != buf_id  # lent to the engine: not handed out again
        del got
        gc.collect()
        assert released == [desc.slab]
        pool.free(desc.slab)  # the engine's Free
        again = receive.take(3 << 20)
        assert id(again) == buf_id
        del again
        receive.take(7 << 20)  # past the limit: the idle 3 MiB buffers are let go
        gone = desc.slab
        assert not os.path.exists(os.path.join(SHM_DIR, gone))
        assert gone in maps._maps
        maps._sweep_at = len(maps._maps)  # (64 mappings in a running engine) the next new one sweeps
        maps.view(pool.alloc(1).name)
        assert gone not in maps._maps
    finally:
        pool.close()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(pool.prefix + "-")]


def test_receive_buffers_leave_a_quarter_of_shared_memory(monkeypatch):
    """With /dev/shm three-quarters full the receive pool maps private memory, and a tensor is copied into a
    slab as before the receive buffers were shared (a full /dev/shm must not starve the slabs)."""
    pool = SlabPool(f"naiad-test{os.getpid()}q")
    receive = ReceivePool(limit=8 << 20)
    receive.share(pool)
    real = os.statvfs(SHM_DIR)

    class Fs:  # 64 MiB in all, 16.5 MiB free
        f_frsize, f_blocks, f_bavail = 4096, 16384, 16 * 256 + 128

    try:
        monkeypatch.setattr(slabs.os, "statvfs", lambda _: Fs)
        assert receive.take(2 << 20) is not None and not pool._segments  # 16.5 - 16 < 2 MiB: private
        Fs.f_bavail = real.f_bavail
        assert receive.take(5 << 20) is not None and pool._segments  # room again: shared
        Fs.f_bavail = 16 * 256 + 128
        buf = receive.take(1 << 20)  # full again: private
        arr = np.frombuffer(memoryview(buf).toreadonly(), np.float32)
        desc = wire.encode_request(InferenceRequest("m", {"X": arr}, {"X": "FP32"}), pool)
        assert "-r" not in desc.slab  # copied into a slab
    finally:
        pool.close()


def test_every_field_a_request_and_a_response_carry_crosses_as_it_was():
    pool = SlabPool(f"naiad-test{os.getpid()}f")
    try:
        x = np.arange(4, dtype=np.int64)
        req = InferenceRequest(
            "m",
            {"X": x},
            {"X": "INT64"},
            model_version=3,
            id="req-9",
            outputs=[RequestedOutput("Y", False, 2, {"k": 1})],
            parameters={"p": "v"},
            priority=2,
            timeout_us=5000,
            correlation_id="seq-a",
            flags=3,
            traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            arrival_ns=123_456_789,  # the worker's clock reading: statistics and queue timeouts count from it
        )
        desc = wire.decoder.decode(wire.encoder.encode(wire.Infer(1, wire.encode_request(req, pool))))
        got = wire.decode_request(desc.request, SlabMaps(), lambda _: None)
        for field in ("model_name", "datatypes", "model_version", "id", "outputs", "parameters", "priority",
                      "timeout_us", "correlation_id", "flags", "traceparent", "arrival_ns"):  # fmt: skip
            assert getattr(got, field) == getattr(req, field), field
        np.testing.assert_array_equal(got.inputs["X"], x)
        # what the engine sets itself starts at its default (decode_request passes every field by position)
        assert (got.response_callback, got.cancelled, got.trace, got.device_inputs, got.device_consumer) == (
            None, False, None, False, False,
        )  # fmt: skip
        assert got.load_wait_ns == 0
        resp = InferenceResponse("m", "3", [OutputTensor("Y", "INT64", x)], id="req-9", parameters={"q": 1.5})
        resp.final = False
        back = wire.decode_response(wire.encode_response(resp, pool), SlabMaps(), lambda _: None)
        assert (back.model_name, back.model_version, back.id, back.parameters, back.final, back.error) == (
            "m", "3", "req-9", {"q": 1.5}, False, None,
        )  # fmt: skip
        np.testing.assert_array_equal(back.outputs[0].data, x)
    finally:
        pool.close()


def test_the_slab_pool_keeps_at_most_its_limit_and_says_what_it_unlinks():
    mib = 1 << 20
    pool = SlabPool(f"naiad-test{os.getpid()}l", limit=4 * mib)
    dropped: list[str] = []
    pool.on_drop = dropped.append
    try:
        exists = lambda name: os.path.exists(os.path.join(SHM_DIR, name))  # noqa: E731
        a, b = pool.alloc(mib), pool.alloc(mib)
        pool.free(a.name)
        pool.free(b.name)
        assert {pool.alloc(mib).name, pool.alloc(mib).name} == {a.name, b.name} and not dropped  # reused
        pool.free(a.name)
        pool.free(b.name)
        huge = pool.alloc(3 * mib)  # a 4 MiB slab, more than half the limit: never kept
        pool.free(huge.name)
        assert dropped == [huge.name] and not exists(huge.name) and pool.bytes == 2 * mib
        big = pool.alloc(2 * mib)  # fits beside the two idle 1 MiB slabs: 4 MiB in all
        c = pool.alloc(mib)  # reuses an idle one
        assert c.name in (a.name, b.name)
        assert pool.alloc(mib).name in (a.name, b.name)  # reuses the other
        e = pool.alloc(mib)  # no idle slab left to evict, past the limit: unlinked once freed
        assert len(dropped) == 1 and pool.bytes == 5 * mib
        pool.free(e.name)
        assert dropped[1:] == [e.name] and not exists(e.name) and pool.bytes == 4 * mib
        pool.free(big.name)  # idle now: the next new slab that does not fit evicts it
        f = pool.alloc(2 * mib)  # a 2 MiB slab: the idle one is reused, nothing evicted
        assert f.name == big.name and len(dropped) == 2
        pool.free(f.name)
        pool.free(c.name)
        g = pool.alloc(256 * 1024)  # a new size class: the idle 2 MiB slab goes first (largest first)
        assert dropped[2:] == [big.name] and not exists(big.name) and exists(g.name)
        assert pool.bytes == 2 * mib + 256 * 1024 and len({a.name, b.name, huge.name, e.name, g.name}) == 5
    finally:
        pool.close()


def test_a_peer_unmaps_a_segment_its_owner_unlinked():
    pool = SlabPool(f"naiad-test{os.getpid()}u")
    maps = SlabMaps()
    try:
        slab = pool.alloc(1 << 20)
        slab.array[:4] = [1, 2, 3, 4]
        view = maps.view(slab.name)[:4].copy()
        assert view.tolist() == [1, 2, 3, 4]
        kept = maps.view(slab.name)[:4]  # a view in use keeps its mapping after the unmap
        os.unlink(os.path.join(SHM_DIR, slab.name))
        maps.unmap([slab.name])
        assert kept.tolist() == [1, 2, 3, 4]
        try:
            maps.view(slab.name)  # the mapping is gone: the name is looked up afresh, and is no more
        except FileNotFoundError:
            pass
        else:
            raise AssertionError("the unlinked segment's mapping was kept")
    finally:
        pool.close()
