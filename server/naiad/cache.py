"""Response cache (`response_cache { enable: true }` with `--cache-config local,size=N`): a bounded LRU of
responses keyed by a hash of the model, version, inputs and requested outputs."""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from .inference import InferenceRequest, InferenceResponse, OutputTensor
from .tensors import serialize_bytes


def request_key(request: InferenceRequest, version: int) -> bytes:
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{request.model_name}\0{version}\0".encode())
    for name in sorted(request.inputs):
        arr = request.inputs[name]
        h.update(f"{name}\0{request.datatypes.get(name)}\0{arr.shape}\0".encode())
        if arr.dtype == np.object_:
            h.update(serialize_bytes(arr))
        else:
            h.update(np.ascontiguousarray(arr).data)
    for out in request.outputs:
        h.update(f"out\0{out.name}\0{out.classification}\0".encode())
    return h.digest()


class ResponseCache:
    def __init__(self, size_bytes: int):
        if size_bytes <= 0:
            raise ValueError("the response cache size must be positive")
        self.capacity = size_bytes
        self.used = 0
        self._entries: collections.OrderedDict[bytes, tuple[list[OutputTensor], int]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> list[OutputTensor] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: bytes, response: InferenceResponse) -> None:
        outputs = [OutputTensor(o.name, o.datatype, np.array(o.data, copy=True)) for o in response.outputs]
        size = (
            sum(
                o.data.nbytes if o.data.dtype != np.object_ else len(serialize_bytes(o.data)) for o in outputs
            )
            + 64
        )
        if size > self.capacity:
            return  # larger than the whole cache: never cached
        old = self._entries.pop(key, None)
        if old is not None:
            self.used -= old[1]
        while self.used + size > self.capacity and self._entries:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.used -= evicted
        self._entries[key] = (outputs, size)
        self.used += size


def parse_cache_config(items: list[str]) -> int:
    """`--cache-config local,size=N` (tritonserver's form) -> size in bytes; 0 when no cache is configured."""
    size = 0
    for item in items:
        kind, _, setting = item.partition(",")
        key, eq, value = setting.partition("=")
        if kind != "local" or key != "size" or not eq or not value.isdigit():
            raise ValueError(f"invalid --cache-config '{item}': expected local,size=<bytes>")
        size = int(value)
    return size
