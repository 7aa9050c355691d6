"""Smoke test of the e2e harness itself: real control plane + kwok + pod runner.

A Deployment asking for ``nvidia.com/gpu: 1`` is scheduled by the real
kube-scheduler onto the simulated GPU node, the pod runner starts real
``python3 -m http.server`` processes bound to the pod IPs (198.18.0.x), the
real endpointslice controller publishes them once they are Ready, and
deleting the Deployment (real garbage collector) stops the processes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
import urllib.request

import pytest

from e2e.cluster import GPU_NODE_LABEL, KwokCluster
from e2e.podrunner import PodRunner

NS = "smoke"
APP = "http-echo"


def _wait(fn, timeout=90, interval=0.3, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


def _json(cluster: KwokCluster, *args) -> dict:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def _http_get(ip: str, port: int = 8000, timeout: float = 2.0) -> int:
    with urllib.request.urlopen(f"http://{ip}:{port}/", timeout=timeout) as r:
        return r.status


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still "exists"; the runner reaps its children, so check state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_versions_and_gpu_node(kwok_cluster: KwokCluster):
    want = kwok_cluster.versions["KUBERNETES_VERSION"]
    assert want.startswith("v1.")
    v = json.loads(kwok_cluster.kubectl("version", "-o", "json").stdout)
    assert v["clientVersion"]["gitVersion"] == want, v
    assert v["serverVersion"]["gitVersion"] == want, v
    # the human-readable form too
    text = kwok_cluster.kubectl("version").stdout
    assert f"Client Version: {want}" in text and f"Server Version: {want}" in text, text

    node = _json(kwok_cluster, "get", "node", "gpu-node-0")
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert node["spec"]["podCIDR"] == kwok_cluster.gpu_nodes[0].pod_cidr
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"


def _manifests() -> list[dict]:
    labels = {"app": APP}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": APP, "namespace": NS},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "nodeSelector": {GPU_NODE_LABEL: "true"},
                        "terminationGracePeriodSeconds": 5,
                        "containers": [
                            {
                                "name": "web",
                                "image": "python:3.11-slim",  # ignored by the pod runner
                                "command": ["python3", "-m", "http.server", "--bind", "$(POD_IP)", "8000"],
                                "env": [
                                    {
                                        "name": "POD_IP",
                                        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                                    }
                                ],
                                "ports": [{"name": "http", "containerPort": 8000}],
                                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                                "readinessProbe": {
                                    "httpGet": {"path": "/", "port": "http"},
                                    "periodSeconds": 1,
                                    "failureThreshold": 1,
                                },
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": APP, "namespace": NS},
            "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
        },
    ]


def test_deployment_runs_real_processes(kwok_cluster: KwokCluster, pod_runner: PodRunner):
    c = kwok_cluster
    c.apply(_manifests())
    try:
        _run_deployment_checks(c, pod_runner)
    finally:
        c.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def _run_deployment_checks(c: KwokCluster, runner: PodRunner):
    cidr = ipaddress.ip_network(c.gpu_nodes[0].pod_cidr)

    def running_pods():
        pods = _json(c, "get", "pods", "-n", NS, "-l", f"app={APP}")["items"]
        ok = [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
        return ok if len(ok) == 2 else None

    pods = _wait(running_pods, what="2 Running pods with IPs")
    ips = sorted(p["status"]["podIP"] for p in pods)
    assert len(set(ips)) == 2
    for p in pods:
        # placed by the real scheduler (the template has no nodeName)
        assert p["spec"]["nodeName"] == "gpu-node-0"
        assert ipaddress.ip_address(p["status"]["podIP"]) in cidr
    events = _json(c, "get", "events", "-n", NS, "--field-selector", "reason=Scheduled")["items"]
    scheduled = {
        e["involvedObject"]["name"]
        for e in events
        if (e.get("reportingComponent") or e.get("source", {}).get("component")) == "default-scheduler"
    }
    assert {p["metadata"]["name"] for p in pods} <= scheduled, events

    # the runner started one real process per pod, bound to the pod IP
    procs = runner.wait_for(
        lambda ps: len([p for p in ps if p.running and p.namespace == NS]) == 2, what="2 running processes"
    )
    procs = [p for p in procs if p.namespace == NS]
    assert sorted(p.pod_ip for p in procs) == ips
    for p in procs:
        assert p.argv[-3:] == ["--bind", p.pod_ip, "8000"]
        assert _pid_alive(p.pid)
    for ip in ips:
        assert _wait(lambda ip=ip: _try_get(ip), timeout=30, what=f"HTTP 200 from {ip}:8000") == 200

    # Ready comes from the runner's readiness probe; the real endpointslice
    # controller then publishes both pod IPs as ready endpoints.
    def ready_pods():
        pods = _json(c, "get", "pods", "-n", NS, "-l", f"app={APP}")["items"]
        rd = [
            p
            for p in pods
            if any(x["type"] == "Ready" and x["status"] == "True" for x in p["status"].get("conditions", []))
        ]
        return rd if len(rd) == 2 else None

    _wait(ready_pods, what="2 Ready pods")

    def endpoint_ips():
        sl = _json(c, "get", "endpointslices", "-n", NS, "-l", f"kubernetes.io/service-name={APP}")["items"]
        got = sorted(
            a
            for s in sl
            for e in (s.get("endpoints") or [])
            if (e.get("conditions") or {}).get("ready")
            for a in e["addresses"]
        )
        return got if got == ips else None

    _wait(endpoint_ips, what=f"EndpointSlice ready addresses == {ips}")
    sl = _json(c, "get", "endpointslices", "-n", NS, "-l", f"kubernetes.io/service-name={APP}")["items"]
    assert any(pt.get("port") == 8000 for s in sl for pt in (s.get("ports") or []))

    # GPUs are accounted by the real scheduler against the node's allocatable:
    # with 2 of 8 in use, a pod asking for 7 must stay Pending.
    c.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "too-big", "namespace": NS},
            "spec": {
                "nodeSelector": {GPU_NODE_LABEL: "true"},
                "containers": [
                    {
                        "name": "x",
                        "image": "none",
                        "command": ["sleep", "600"],
                        "resources": {"limits": {"nvidia.com/gpu": "7"}},
                    }
                ],
            },
        }
    )

    def unschedulable():
        p = _json(c, "get", "pod", "too-big", "-n", NS)
        cond = [x for x in p["status"].get("conditions", []) if x["type"] == "PodScheduled"]
        return cond and cond[0]["status"] == "False" and "nvidia.com/gpu" in cond[0].get("message", "")

    _wait(unschedulable, what="too-big Unschedulable for Insufficient nvidia.com/gpu")
    c.kubectl("delete", "pod", "too-big", "-n", NS, "--wait=false")

    # delete the Deployment: the real garbage collector deletes the ReplicaSet
    # and pods, kwok finalises the pod deletion, the runner stops the processes
    pids = [p.pid for p in procs]
    c.kubectl("delete", "deployment", APP, "-n", NS, "--wait=false")
    _wait(lambda: not _json(c, "get", "pods", "-n", NS, "-l", f"app={APP}")["items"], what="pods deleted")
    _wait(lambda: not runner.running(NS), timeout=30, what="runner processes stopped")
    _wait(lambda: not any(_pid_alive(pid) for pid in pids), timeout=30, what="pids gone")
    for ip in ips:
        with pytest.raises(OSError):
            _http_get(ip, timeout=1)
    _wait(lambda: not _json(c, "get", "replicasets", "-n", NS)["items"], what="ReplicaSet garbage-collected")


def _try_get(ip: str):
    try:
        return _http_get(ip)
    except OSError:
        return None
