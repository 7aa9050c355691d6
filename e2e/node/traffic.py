"""Inference traffic for the real-node tests: a client pod that calls a Service's ClusterIP (through kube-proxy)
until told to stop and then prints what failed, and a concurrent load from the test's own process."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from e2e.node.node import REAL_NODE_TOLERATION

#: the KServe v2 request every client sends to identity_fp32 (and what it must get back)
IDENTITY_INPUT = [1.0, 2.0, 3.0]
IDENTITY_REQUEST = {
    "inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": IDENTITY_INPUT}]
}

#: run by the server image's python in the client pod: ``python3 -c CLIENT_SCRIPT URL THREADS KEEPALIVE JSON``.
#: THREADS threads open a new connection per request (kube-proxy picks a backend per connection, as for any
#: short-lived client), KEEPALIVE threads each reuse one connection until the server closes it (as HTTP client
#: pools do); all stop when /tmp/stop exists, then the script prints one ``client-summary {json}`` line.
CLIENT_SCRIPT = r"""
import http.client, json, os, sys, threading, time, urllib.error, urllib.parse, urllib.request

url, threads, keepalive, request_json = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
body = request_json.encode()
expected = json.loads(request_json)["inputs"][0]["data"]  # an identity model answers its input
lock = threading.Lock()
ok, failures, latencies, first = [0], [], [], threading.Event()


def answered(start, out, kind):
    if out["outputs"][0]["data"] != expected:
        raise ValueError(f"wrong answer {out}")
    with lock:
        ok[0] += 1
        ok.append(kind)
        latencies.append(time.monotonic() - start)
    first.set()


def one():
    start = time.monotonic()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            answered(start, json.loads(r.read()), "new")
    except urllib.error.HTTPError as e:
        return f"new connection: HTTP {e.code}: {e.read()[:200]!r}"
    except Exception as e:
        return f"new connection: {type(e).__name__}: {e}"[:300]
    return None


def worker():
    while not os.path.exists("/tmp/stop"):
        error = one()
        if error is not None:
            with lock:
                failures.append({"time": time.time(), "error": error})
        time.sleep(0.005)


def keepalive_worker():
    # one connection, reused until the server says Connection: close or it breaks (as HTTP client pools do)
    parts, conn = urllib.parse.urlsplit(url), None
    while not os.path.exists("/tmp/stop"):
        conn = conn or http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        start, error = time.monotonic(), None
        try:
            conn.request("POST", parts.path, body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            if r.status != 200:
                error = f"keep-alive: HTTP {r.status}: {data[:200]!r}"
            else:
                answered(start, json.loads(data), "keep-alive")
            if r.will_close:
                conn.close()
                conn = None
        except Exception as e:
            error = f"keep-alive: {type(e).__name__}: {e}"[:300]
            conn.close()
            conn = None
        if error is not None:
            with lock:
                failures.append({"time": time.time(), "error": error})
        time.sleep(0.005)


workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
workers += [threading.Thread(target=keepalive_worker, daemon=True) for _ in range(keepalive)]
for w in workers:
    w.start()
first.wait(120)
print(f"client: first answer at {time.time():.3f}", flush=True)
for w in workers:
    w.join()
latencies.sort()
summary = {
    "ok": ok[0],
    "ok_keepalive": ok[1:].count("keep-alive"),
    "failed": len(failures),
    "failed_new": sum(f["error"].startswith("new connection") for f in failures),
    "failed_keepalive": sum(f["error"].startswith("keep-alive") for f in failures),
    "failures": failures[:20],
    "p50_ms": round(latencies[len(latencies) // 2] * 1000, 2) if latencies else None,
    "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2) if latencies else None,
}
print("client-summary " + json.dumps(summary), flush=True)
"""


def client_pod(
    name: str, namespace: str, image: str, url: str, node: str, threads: int = 2, keepalive: int = 0
) -> dict[str, Any]:
    """A pod on the real node running CLIENT_SCRIPT against `url` from the server image's python: `threads` with
    a new connection per request, `keepalive` with one reused connection each."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "naiad-e2e-client"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [REAL_NODE_TOLERATION],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "client",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": [
                        "python3",
                        "-c",
                        CLIENT_SCRIPT,
                        url,
                        str(threads),
                        str(keepalive),
                        json.dumps(IDENTITY_REQUEST),
                    ],
                    "resources": {
                        "requests": {"cpu": "50m", "memory": "64Mi"},
                        "limits": {"memory": "256Mi"},
                    },
                }
            ],
        },
    }


def client_summary(logs: str) -> dict[str, Any] | None:
    """The client pod's summary line, or None before it printed one."""
    for line in logs.splitlines():
        if line.startswith("client-summary "):
            return json.loads(line.split(" ", 1)[1])
    return None


@dataclass(frozen=True)
class LoadFigures:
    """What a concurrent load measured from the client's side."""

    tool: str
    requests: int  # answered with 200
    failed: int  # errors and other statuses
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


#: wrk's script: POST the identity request, print the figures as one JSON line
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '@BODY@'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK_RESULT {"requests": %d, "duration_us": %d, "errors": %d, "status": %d, ' ..
    '"p50_us": %d, "p99_us": %d}\\n', summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status, latency:percentile(50), latency:percentile(99)))
end
""".replace("@BODY@", json.dumps(IDENTITY_REQUEST))


def concurrent_load(host: str, port: int, connections: int, seconds: float) -> LoadFigures:
    """`connections` keep-alive connections sending IDENTITY_REQUEST to identity_fp32 back to back for `seconds`:
    with ``wrk`` (one thread) where it is installed (``apt-get install wrk``, as bench/setup.sh does), else from
    Python threads in this process (which cannot load a server past a fraction of a CPU)."""
    url = f"http://{host}:{port}/v2/models/identity_fp32/infer"
    if shutil.which("wrk") is None:
        return _python_load(host, port, connections, seconds)
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(WRK_SCRIPT)
        script.flush()
        cmd = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "-s", script.name, url]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    match = re.search(r"^WRK_RESULT (\{.*\})$", p.stdout, re.M)
    if p.returncode != 0 or match is None:
        raise RuntimeError(f"wrk failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")
    r = json.loads(match.group(1))
    return LoadFigures(
        tool="wrk",
        requests=r["requests"] - r["status"],
        failed=r["errors"] + r["status"],
        seconds=r["duration_us"] / 1e6,
        p50_ms=r["p50_us"] / 1e3,
        p99_ms=r["p99_us"] / 1e3,
    )


def _python_load(host: str, port: int, connections: int, seconds: float) -> LoadFigures:
    body = json.dumps(IDENTITY_REQUEST).encode()
    lock = threading.Lock()
    latencies: list[float] = []
    failures = [0]
    deadline = time.monotonic() + seconds

    def worker() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        mine: list[float] = []
        failed = 0
        while time.monotonic() < deadline:
            start = time.monotonic()
            try:
                conn.request(
                    "POST", "/v2/models/identity_fp32/infer", body, {"Content-Type": "application/json"}
                )
                response = conn.getresponse()
                response.read()
            except OSError:
                failed += 1
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=10)
                continue
            if response.status != 200:
                failed += 1
                continue
            mine.append(time.monotonic() - start)
        conn.close()
        with lock:
            latencies.extend(mine)
            failures[0] += failed

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies.sort()

    def percentile(p: float) -> float:
        return (
            latencies[min(len(latencies) - 1, int(len(latencies) * p))] * 1000 if latencies else float("nan")
        )

    return LoadFigures("python", len(latencies), failures[0], seconds, percentile(0.5), percentile(0.99))
