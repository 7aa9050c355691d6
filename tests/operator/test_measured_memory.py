"""Placement by measured memory: the servers' repository index figures replace declared memory once measured."""

from __future__ import annotations

from naiad_operator.control import IndexEntry, _measured_bytes
from naiad_operator.measured_memory import measured_memory, placement_memory
from naiad_operator.placement import Capacity, Demand, PodState, plan_pool

GIB = 1 << 30


def test_measured_memory_is_the_largest_figure_of_a_ready_model():
    index = {
        "pod-a": [
            IndexEntry("bert", "1", "READY", memory_bytes=2 * GIB),
            IndexEntry("resnet", "1", "READY", memory_bytes=None),  # declared only: not measured
            IndexEntry("gone", "1", "UNAVAILABLE", "unloaded", memory_bytes=5 * GIB),
        ],
        "pod-b": [IndexEntry("bert", "1", "READY", memory_bytes=3 * GIB)],
        "pod-c": None,  # index unreadable
    }
    measured = measured_memory(index)
    assert measured == {"bert": 3 * GIB}
    assert placement_memory(1 * GIB, "bert", measured) == 3 * GIB
    assert placement_memory(1 * GIB, "resnet", measured) == 1 * GIB


def test_index_entries_give_measured_bytes_only_when_measured():
    measured = {"memory_source": "measured", "host_memory_bytes": 100, "gpu_memory_bytes": 20}
    assert _measured_bytes(measured) == 120
    assert _measured_bytes({**measured, "memory_source": "declared"}) is None
    assert _measured_bytes({"name": "m", "state": "READY"}) is None  # a Triton or older Naiad server


def test_a_pool_packs_as_many_models_as_their_measured_memory_allows():
    pods = [PodState("p", "10.0.0.1", True)]
    capacity = Capacity(memory=4 * GIB)
    declared = [Demand(f"m{i}", "r", 1, memory=3 * GIB) for i in range(4)]
    placed = plan_pool(declared, pods, capacity)
    assert sum(bool(p.load) for p in placed.values()) == 1
    # another pool's pods measured each at 1 GiB
    measured = measured_memory({"q": [IndexEntry(f"m{i}", "1", "READY", memory_bytes=GIB) for i in range(4)]})
    demands = [
        Demand(d.name, d.revision, 1, memory=placement_memory(d.memory, d.name, measured)) for d in declared
    ]
    placed = plan_pool(demands, pods, capacity)
    assert sum(bool(p.load) for p in placed.values()) == 4
