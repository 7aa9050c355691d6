"""The operator's Kubernetes client (naiad_operator/kube.py, over aiohttp) against the maintained clients, on the
calls the operator makes most: GET of one object, LIST of a pool's pods (label selector), merge PATCH of a pod.

    python tools/kube_client_bench.py [--kubeconfig FILE] [--pods 50] [--requests 300]

Without --kubeconfig it starts an e2e control plane (e2e/cluster.py, kwok: real kube-apiserver and etcd) and
deletes it afterwards. Clients measured, each in the same process and event loop:

* kube.py (what the operator uses; aiohttp, dicts in and out);
* kubernetes_asyncio (if importable), typed: CoreV1Api returning model objects, as its documentation uses it;
* kubernetes_asyncio raw: the same calls with _preload_content=False and json.loads (dicts, as the operator
  works with them);
* kubernetes (the synchronous package the project already depends on) through asyncio.to_thread.

For each: requests per second (one at a time, and 16 in flight) and the client's CPU per request (process CPU
time over the run: the API server runs in other processes). Prints a JSON table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT)]

NS = "bench"
LABEL = "naiad.dev/bench=1"


def pod(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"p-{i:03d}", "namespace": NS, "labels": {"naiad.dev/bench": "1"}},
        # Unschedulable on purpose: the objects only need to exist.
        "spec": {"nodeSelector": {"naiad.dev/none": "x"}, "containers": [{"name": "c", "image": "x"}]},
    }


async def measure(call: Callable[[int], Awaitable[Any]], requests: int, concurrency: int) -> dict[str, float]:
    await call(0)  # connection set up, caches warm
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with slots:
            await call(i)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"per_second": round(requests / wall, 1), "cpu_ms_per_request": round(1000 * cpu / requests, 3)}


async def kube_py_calls(kubeconfig: str) -> tuple[dict[str, Callable[[int], Awaitable[Any]]], Callable]:
    import kopf

    from naiad_operator.kube import KubeClient

    settings = kopf.OperatorSettings()
    with _kubeconfig_env(kubeconfig):
        info = kopf.login_with_kubeconfig(logger=_logger(), settings=settings)
    assert info is not None
    kube = KubeClient.from_info(info)
    calls = {
        "get": lambda i: kube.get("v1", "Pod", NS, "p-000"),
        "list": lambda i: kube.list("v1", "Pod", NS, LABEL),
        "patch": lambda i: kube.patch("v1", "Pod", NS, "p-001", {"metadata": {"annotations": {"n": str(i)}}}),
    }
    return calls, kube.close


async def kubernetes_asyncio_calls(kubeconfig: str, raw: bool):
    from kubernetes_asyncio import client, config

    api_client = client.ApiClient(await _async_config(config, kubeconfig))
    core = client.CoreV1Api(api_client)

    async def body(response: Any) -> Any:
        return json.loads(await response.read()) if raw else response

    extra = {"_preload_content": False} if raw else {}
    calls = {
        "get": lambda i: _then(core.read_namespaced_pod("p-000", NS, **extra), body),
        "list": lambda i: _then(core.list_namespaced_pod(NS, label_selector=LABEL, **extra), body),
        "patch": lambda i: _then(
            core.patch_namespaced_pod("p-001", NS, {"metadata": {"annotations": {"n": str(i)}}}, **extra),
            body,
        ),
    }
    return calls, api_client.close


async def _then(call: Awaitable[Any], then: Callable[[Any], Awaitable[Any]]) -> Any:
    response = await call
    result = await then(response)
    if hasattr(response, "release"):
        response.release()
    return result


async def _async_config(config: Any, kubeconfig: str) -> Any:
    from kubernetes_asyncio.client import Configuration

    conf = Configuration()
    await config.load_kube_config(config_file=kubeconfig, client_configuration=conf)
    return conf


async def kubernetes_sync_calls(kubeconfig: str):
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=kubeconfig)
    api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] = 16
    core = client.CoreV1Api(api_client)
    calls = {
        "get": lambda i: asyncio.to_thread(core.read_namespaced_pod, "p-000", NS),
        "list": lambda i: asyncio.to_thread(core.list_namespaced_pod, NS, label_selector=LABEL),
        "patch": lambda i: asyncio.to_thread(
            core.patch_namespaced_pod, "p-001", NS, {"metadata": {"annotations": {"n": str(i)}}}
        ),
    }

    async def close() -> None:
        api_client.close()

    return calls, close


@contextlib.contextmanager
def _kubeconfig_env(path: str):
    import os

    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old


def _logger():
    import logging

    return logging.getLogger("kube_client_bench")


async def run(kubeconfig: str, requests: int) -> dict[str, Any]:
    clients: dict[str, Callable[[], Awaitable[Any]]] = {
        "kube.py (aiohttp)": lambda: kube_py_calls(kubeconfig),
        "kubernetes (sync, to_thread)": lambda: kubernetes_sync_calls(kubeconfig),
    }
    try:
        import kubernetes_asyncio  # noqa: F401

        clients["kubernetes_asyncio (typed)"] = lambda: kubernetes_asyncio_calls(kubeconfig, raw=False)
        clients["kubernetes_asyncio (dicts)"] = lambda: kubernetes_asyncio_calls(kubeconfig, raw=True)
    except ImportError:
        print("kubernetes_asyncio is not importable: skipped", file=sys.stderr)
    table: dict[str, Any] = {}
    for name, make in clients.items():
        calls, close = await make()
        row = {}
        for op, call in calls.items():
            for concurrency in (1, 16):
                row[f"{op} c{concurrency}"] = await measure(call, requests, concurrency)
        await close()
        table[name] = row
    return table


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kubeconfig")
    parser.add_argument("--pods", type=int, default=50, help="pods the LIST returns")
    parser.add_argument("--requests", type=int, default=300, help="requests per client, call and concurrency")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        kubeconfig = args.kubeconfig
        if kubeconfig is None:
            from e2e.cluster import KwokCluster

            cluster = stack.enter_context(KwokCluster())
            kubeconfig = cluster.kubeconfig
            cluster.kubectl("create", "namespace", NS)
            cluster.apply([pod(i) for i in range(args.pods)])
        table = asyncio.run(run(kubeconfig, args.requests))
    print(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
