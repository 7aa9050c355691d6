"""A closed-loop load generator: N concurrent clients send KServe v2 inference requests, latencies are recorded."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
import orjson

# KServe datatype -> numpy dtype for the random inputs.
_DTYPES = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


@dataclass
class Measurement:
    """One load level: `concurrency` clients for `seconds`; latencies in milliseconds."""

    concurrency: int
    seconds: float
    requests: int
    errors: int
    throughput: float  # inferences per second
    p50_ms: float
    p90_ms: float
    p99_ms: float
    avg_ms: float


def request_body(metadata: dict, shapes: dict[str, list[int]], batch_size: int, seed: int = 0) -> dict:
    """A v2 inference request for a model's metadata, random data; variable dims from `shapes`, else 1."""
    rng = np.random.default_rng(seed)
    inputs = []
    for spec in metadata["inputs"]:
        name, datatype = spec["name"], spec["datatype"]
        shape = list(spec["shape"])
        batched = bool(shape) and shape[0] == -1 and metadata.get("_max_batch_size", 0) > 0
        dims = shape[1:] if batched else shape
        given = shapes.get(name)
        if given is not None:
            dims = list(given)
        dims = [1 if d < 0 else d for d in dims]
        full = ([batch_size] if batched else []) + dims
        if datatype == "BYTES":
            data = ["x"] * int(np.prod(full, dtype=np.int64))
        elif datatype not in _DTYPES:
            raise ValueError(f"input {name}: datatype {datatype} is not supported by the load generator")
        elif datatype.startswith("FP"):
            data = rng.random(full).astype(_DTYPES[datatype]).ravel().tolist()
        elif datatype == "BOOL":
            data = rng.integers(0, 2, full).astype(bool).ravel().tolist()
        else:
            data = rng.integers(0, 100, full).astype(_DTYPES[datatype]).ravel().tolist()
        inputs.append({"name": name, "datatype": datatype, "shape": full, "data": data})
    return {"inputs": inputs}


async def _measure(
    url: str, model: str, body: dict, concurrency: int, seconds: float, warmup: float, batch: int
):
    latencies: list[float] = []
    errors = 0
    target = f"{url}/v2/models/{model}/infer"
    payload = orjson.dumps(body)  # serialised once: the generator shares the machine with the server
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        record_from = start + warmup
        stop_at = record_from + seconds

        async def client() -> None:
            nonlocal errors
            while True:
                t0 = time.perf_counter()
                if t0 >= stop_at:
                    return
                async with session.post(target, data=payload, headers=headers) as resp:
                    await resp.read()
                    ok = resp.status == 200
                t1 = time.perf_counter()
                if t0 >= record_from and t1 <= stop_at:
                    if ok:
                        latencies.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    lat = np.array(latencies) * 1000.0 if latencies else np.array([float("nan")])
    return Measurement(
        concurrency=concurrency,
        seconds=seconds,
        requests=len(latencies),
        errors=errors,
        throughput=len(latencies) * batch / seconds,
        p50_ms=float(np.percentile(lat, 50)),
        p90_ms=float(np.percentile(lat, 90)),
        p99_ms=float(np.percentile(lat, 99)),
        avg_ms=float(lat.mean()),
    )


def measure(
    url: str, model: str, body: dict, concurrency: int, seconds: float, warmup: float = 0.5, batch: int = 1
) -> Measurement:
    """Run `concurrency` closed-loop clients for `warmup + seconds`; only the last `seconds` are recorded."""
    return asyncio.run(_measure(url, model, body, concurrency, seconds, warmup, batch))
