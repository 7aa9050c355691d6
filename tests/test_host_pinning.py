"""Page-locked request buffers (naiad.host_pinning) with a stand-in CUDA runtime: what is registered, when it is
unregistered (never under a view), the pinned pool's budget, and a driver that refuses. The real cudaHostRegister
runs in tests/test_gpu.py on a GPU."""

from __future__ import annotations

import enum
import gc
import logging
import os

from naiad import host_pinning, memory
from naiad.engine import slabs
from naiad.engine.slabs import SHM_DIR, SlabMaps, SlabPool
from naiad.frontends.transport.receive_buffers import ReceivePool
from naiad.host_pinning import HostPinning, address_of


class _Err(enum.Enum):
    cudaSuccess = 0
    cudaErrorHostMemoryAlreadyRegistered = 712


class Runtime:
    """cudaHostRegister / cudaHostUnregister as cuda.bindings.runtime answers them, recording the ranges."""

    cudaError_t = _Err
    cudaHostRegisterPortable = 1

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.registered: dict[int, int] = {}
        self.calls = 0

    def cudaHostRegister(self, addr: int, size: int, flags: int):
        self.calls += 1
        assert flags == self.cudaHostRegisterPortable
        if self.refuse or addr in self.registered:
            return (_Err.cudaErrorHostMemoryAlreadyRegistered,)
        self.registered[addr] = size
        return (_Err.cudaSuccess,)

    def cudaHostUnregister(self, addr: int):
        del self.registered[addr]  # unregistering what was not registered is a bug: KeyError
        return (_Err.cudaSuccess,)


def test_pin_once_within_the_pool_and_unpin_gives_the_bytes_back():
    rt, pools = Runtime(), memory.MemoryPools(pinned_bytes=6 << 20)
    pinning = HostPinning(rt, pools)
    a, b = bytearray(2 << 20), bytearray(2 << 20)
    assert pinning.pin(a) and pinning.pin(a)  # idempotent: registered once
    assert rt.registered == {address_of(a)[0]: 2 << 20} and pools.pinned_used == 2 << 20
    # past half of --pinned-memory-pool-byte-size (the rest is the staging buffers'): stays pageable, the driver
    # is not asked
    assert not pinning.pin(b)
    assert rt.calls == 1
    assert pools.reserve_pinned(3 << 20)  # a backend's staging buffer still finds its half
    pools.release_pinned(3 << 20)
    pinning.unpin(a)
    pinning.unpin(b)  # never pinned: nothing to do
    assert rt.registered == {} and pools.pinned_used == 0
    assert pinning.pin(b)


def test_a_refusing_driver_is_reported_once_and_not_asked_again(caplog):
    rt, pools = Runtime(refuse=True), memory.MemoryPools(pinned_bytes=1 << 30)
    pinning = HostPinning(rt, pools)
    with caplog.at_level(logging.WARNING, "naiad.memory"):
        assert not pinning.pin(bytearray(1 << 20))
        assert not pinning.pin(bytearray(1 << 20))
    assert rt.calls == 1 and pools.pinned_used == 0
    assert [r.getMessage() for r in caplog.records] == [
        "request buffers stay pageable: cudaHostRegister failed (cudaErrorHostMemoryAlreadyRegistered)"
    ]


def test_receive_pool_pins_the_buffers_it_keeps_and_unpins_before_letting_go():
    rt = Runtime()
    pool = ReceivePool(limit=4 << 20)
    pool.pinning = HostPinning(rt, memory.MemoryPools(pinned_bytes=1 << 30))
    buf = pool.take(3 << 20)
    assert address_of(buf)[0] in rt.registered
    own = pool.take(3 << 20)  # over the pool's limit while `buf` is in use: a buffer of its own, not pinned
    assert address_of(own)[0] not in rt.registered and len(rt.registered) == 1
    del buf, own
    other = pool.take((3 << 20) + (1 << 18))  # another size class: the idle buffer is evicted first
    assert list(rt.registered) == [address_of(other)[0]]


def test_engine_maps_are_unpinned_only_once_no_view_is_left():
    rt = Runtime()
    owner = SlabPool(f"naiad-pintest{os.getpid()}")
    maps = SlabMaps(HostPinning(rt, memory.MemoryPools(pinned_bytes=1 << 30)))
    try:
        view = maps.view(owner.alloc(1 << 20).name)[100:200]  # a request's tensor
        assert len(rt.registered) == 1
        maps.forget(owner.prefix)  # the worker is gone while a model still reads the tensor
        assert len(rt.registered) == 1, "unregistered under a view"
        del view
        gc.collect()
        maps.forget(owner.prefix)
        assert rt.registered == {}
    finally:
        owner.close()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(owner.prefix + "-")]


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_an_idle_mapping_gives_its_page_lock_to_a_new_one_when_the_budget_is_used(monkeypatch, caplog):
    """Many workers' segments outgrow the request buffers' half of the pinned pool: a mapping unused for
    PIN_IDLE_S with no view left is unpinned for one in use, never one in use or one being read."""
    clock = _Clock()
    monkeypatch.setattr(slabs, "time", clock)
    rt = Runtime()
    owner = SlabPool(f"naiad-pintest{os.getpid()}")
    maps = SlabMaps(HostPinning(rt, memory.MemoryPools(pinned_bytes=6 << 20)))  # 3 MiB for request buffers
    a, b = owner.alloc(2 << 20).name, owner.alloc(2 << 20).name

    def pinned() -> set[str]:
        return {n for n in (a, b) if address_of(maps.view(n))[0] in rt.registered}

    try:
        with caplog.at_level(logging.INFO, "naiad.memory"):
            maps.view(a)
            maps.view(b)  # `a` was used just now: `b` stays pageable, nothing is unpinned
        assert len(rt.registered) == 1 and address_of(maps.view(a))[0] in rt.registered
        assert [r.getMessage() for r in caplog.records] == [
            "request buffers past 3 MiB stay pageable (half of --pinned-memory-pool-byte-size is theirs); a "
            "larger pool page-locks more of them"
        ]
        clock.now += 0.5
        maps.view(b)  # too soon to try again
        assert rt.calls == 1
        clock.now += slabs.PIN_IDLE_S
        maps.view(b)  # `a` idle, nothing reads it: its bytes go to `b`
        assert len(rt.registered) == 1 and address_of(maps.view(b))[0] in rt.registered
        reading = maps.view(b)[100:200]  # a request's tensor in `b`
        clock.now += 2 * slabs.PIN_IDLE_S
        maps.view(a)  # `b` is idle but still read: it keeps its page lock
        assert pinned() == {b}
        del reading
        gc.collect()
        clock.now += 2 * slabs.PIN_IDLE_S
        maps.view(a)
        assert pinned() == {a}
        calls = rt.calls
        for _ in range(10):  # both in use: neither is unpinned for the other, however often they alternate
            clock.now += 0.1
            maps.view(a)
            maps.view(b)
        assert rt.calls == calls and pinned() == {a}
        maps.forget(owner.prefix)
        assert rt.registered == {}
    finally:
        owner.close()


def test_no_pinning_without_gpus_or_pool(monkeypatch):
    assert host_pinning.for_gpus(0) is None
    monkeypatch.setattr(memory, "pools", memory.MemoryPools(pinned_bytes=0))
    assert host_pinning.for_gpus(1) is None
    monkeypatch.setattr(memory, "pools", memory.MemoryPools())
    monkeypatch.setattr(host_pinning.cuda_runtime, "cuda_unavailable_reason", lambda: "no CUDA here")
    assert host_pinning.for_gpus(1) is None
    monkeypatch.setattr(host_pinning.cuda_runtime, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(host_pinning.cuda_runtime, "cudart", Runtime)
    pinning = host_pinning.for_gpus(1)
    assert isinstance(pinning, HostPinning) and pinning.pools is memory.pools
