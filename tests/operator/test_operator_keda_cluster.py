"""An InferenceServer with minReplicas 0 on the real control plane: the operator renders an HTTPScaledObject, and
KEDA v2.21.0 with its HTTP add-on v0.12.0 (built from their Go modules by tools/go/build.sh keda, run as local
processes: e2e/keda.py) scale the pool to zero pods when idle and wake it on a request: the add-on's interceptor
holds the request while KEDA scales the InferenceServer to one pod, the operator renders its Deployment, the pod
starts and the server loads the model on demand. Clients through the interceptor before, at and after zero: no
request fails.

Same harness as test_operator_cluster.py (its own cluster). Run: pytest tests/operator/test_operator_keda_cluster.py
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from test_operator_cluster import (  # noqa: F401 (fixtures)
    NS,
    harness,
    model,
    pool,
    report,
    wait,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

POOL = "waking"
HOST = f"{POOL}.{NS}"
IDLE_SECONDS = 15
BODY = json.dumps(
    {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]},
            {"name": "INPUT1", "datatype": "FP32", "shape": [4], "data": [1, 1, 1, 1]},
        ]
    }
).encode()


@pytest.fixture(scope="module")
def keda_tools():
    """KEDA's and the add-on's binaries and CRDs, had before the harness starts (the cluster may move this process
    into a network namespace of its own, off the network)."""
    from e2e import keda

    try:
        return keda.binaries(), keda.crds_dir()
    except Exception as error:  # built by `make cluster-tools`: a failure here is the build's
        pytest.fail(f"KEDA is not built: {error}")


@pytest.fixture(scope="module")
def keda_cluster(keda_tools, harness):  # noqa: F811
    from e2e import keda

    bin_dir, crds = keda_tools
    node_ip = harness.cluster.gpu_nodes[0].node_ip
    running = keda.Keda(harness.cluster, harness.workdir / "keda", bin_dir, crds, admin_address=node_ip)
    try:
        running.start()
        yield harness, running
    finally:
        running.stop()


def infer(url: str, timeout: float = 180) -> tuple[int, str, float]:
    """One add_sub request through the interceptor; (status, body or error, seconds)."""
    request = urllib.request.Request(
        f"{url}/v2/models/add_sub/infer",
        data=BODY,
        method="POST",
        headers={"Content-Type": "application/json", "Host": HOST},
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(), time.monotonic() - start
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace") + f" {dict(error.headers)}"
        return error.code, text, time.monotonic() - start
    except OSError as error:
        return 0, repr(error), time.monotonic() - start


class Clients:
    """`workers` threads sending requests through the interceptor while `on` is set, `gap` seconds apart."""

    def __init__(self, url: str, workers: int = 2, gap: float = 0.1):
        self.url, self.gap = url, gap
        self.on, self.stop = threading.Event(), threading.Event()
        self.ok = 0
        self.t0 = time.monotonic()
        self.failures: list[str] = []
        self.latencies: list[float] = []
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(workers)]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(200)

    def _loop(self):
        while not self.stop.is_set():
            if not self.on.wait(0.1):
                continue
            status, text, seconds = infer(self.url)
            if status == 200 and '"OUTPUT0"' in text:
                self.ok += 1
                self.latencies.append(seconds)
            else:
                self.failures.append(
                    f"at {time.monotonic() - self.t0:.2f} s ({threading.current_thread().name}): {status}: {text[:300]}"
                )
            self.stop.wait(self.gap)


def pods(h, terminating: bool = False) -> list[dict]:
    """The pool's pods; those being deleted only with `terminating`."""
    return [
        p
        for p in h.get("pods", selector=f"naiad.dev/server={POOL}")["items"]
        if terminating or not p["metadata"].get("deletionTimestamp")
    ]


def test_a_pool_at_zero_pods_wakes_on_a_request_through_the_interceptor(keda_cluster):
    h, running = keda_cluster
    h.apply(
        model(
            "wakeful", serverRef={"name": POOL}, modelName="add_sub", replicas=1, minReplicas=0, idleSeconds=8
        )
    )
    h.apply(
        pool(
            POOL,
            replicas=1,
            minReplicas=0,
            maxReplicas=2,
            scaleToZero={
                "idleSeconds": IDLE_SECONDS,
                "startTimeoutSeconds": 120,
                "responseTimeoutSeconds": 60,
            },
            modelRepository={"path": str(h.repo)},
            resources={},
        )
    )
    so = wait(
        lambda: h.exists("httpscaledobject", POOL) and h.get("httpscaledobject", POOL),
        60,
        what="HTTPScaledObject",
    )
    assert so["spec"]["scaleTargetRef"]["kind"] == "InferenceServer"
    wait(lambda: h.exists("scaledobject", POOL), 60, what="the add-on's ScaledObject")
    assert not h.exists("horizontalpodautoscaler", POOL)  # KEDA's HPA (keda-hpa-<name>), not the operator's
    # nothing calls it: KEDA takes the pool to zero pods after idleSeconds
    wait(lambda: h.get("inferenceserver", POOL)["spec"].get("replicas") == 0, 120, what="replicas 0")
    wait(lambda: not pods(h), 120, what="no pods")
    conditions = wait(
        lambda: (
            {
                c["type"]: (c["status"], c["reason"])
                for c in h.get("inferenceserver", POOL)["status"]["conditions"]
            }
            if h.get("inferenceserver", POOL)["status"].get("replicas") == 0
            else None
        ),
        60,
        what="the status at zero pods",
    )
    assert conditions["Ready"][0] == "True" and conditions["AutoscalerReady"] == ("True", "Delegated"), (
        conditions
    )
    print(f"{POOL}: at zero pods")

    # the first requests wake it: held by the interceptor while a pod starts, then loaded on demand
    wakes = []
    with Clients(running.proxy_url, workers=4, gap=0.2) as clients:

        def wake(what: str) -> None:
            before, start = clients.ok, time.monotonic()
            clients.on.set()
            wait(lambda: clients.ok >= before + 4, 180, what=what)
            wakes.append(time.monotonic() - start)

        wake("the first answers")
        assert len(pods(h)) >= 1
        time.sleep(5)  # traffic on a woken pool
        clients.on.clear()
        # idle: KEDA takes it to zero again, and requests that arrive while its pod stops wake it at once
        wait(lambda: h.get("inferenceserver", POOL)["spec"].get("replicas") == 0, IDLE_SECONDS + 60, what="0")
        wake("the answers while the pod stops")
        time.sleep(2)
        clients.on.clear()
        # gone, not only terminating: a wake from zero pods (the second wake is the one that meets a stopping pod)
        wait(lambda: not pods(h, terminating=True), IDLE_SECONDS + 120, what="no pods again")
        wake("the answers after a wake from zero pods")
        time.sleep(2)
    events = h.kubectl("-n", NS, "get", "events", "--field-selector", f"involvedObject.name={POOL}").stdout
    print(f"{POOL}: 4 answers {', '.join(f'{w:.1f}' for w in wakes)} s after the first requests of each wake")
    print(f"{POOL}: {clients.ok} ok, {len(clients.failures)} failed; events:\n{events[-2000:]}")
    for failure in clients.failures:
        print("failed:", failure[:600])
    if clients.failures:  # (pytest cuts a long assertion message short: the interceptor's reason goes here)
        print(running.logs(3000))
    assert not clients.failures, clients.failures[:5]
