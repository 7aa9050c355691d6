"""Smoke test of e2e/monitoring.py: Debian's prometheus discovers a pod run by
the pod runner, prometheus-adapter serves its metric as a custom metric, and
the real HPA controller scales the Deployment on it."""

from __future__ import annotations

import json
import time

import pytest

from e2e.cluster import GPU_NODE_LABEL, KwokCluster
from e2e.monitoring import Prometheus, PrometheusAdapter, find_prometheus
from e2e.podrunner import PodRunner

NS = "mon"
APP = "metrics-demo"

# a tiny exporter: queue depth 10 per pod, a request counter
EXPORTER = r"""
import http.server, os, sys
ip = os.environ["POD_IP"]
n = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global n
        n += 1
        body = ("# TYPE demo_queue_depth gauge\ndemo_queue_depth 10\n"
                "# TYPE demo_requests_total counter\ndemo_requests_total %d\n" % n).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer((ip, 9100), H).serve_forever()
"""


def _wait(fn, timeout=120, interval=1.0, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}")


@pytest.fixture(scope="module")
def prometheus_bin():
    b = find_prometheus()
    if not b:
        pytest.skip("prometheus binary missing (apt-get install prometheus)")
    return b


def test_prometheus_adapter_hpa(kwok_cluster: KwokCluster, pod_runner: PodRunner, prometheus_bin):
    c = kwok_cluster
    labels = {"app": APP}
    c.apply(
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": APP, "namespace": NS},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "nodeSelector": {GPU_NODE_LABEL: "true"},
                            "terminationGracePeriodSeconds": 2,
                            "containers": [
                                {
                                    "name": "exporter",
                                    "image": "none",
                                    "command": ["python3", "-c", EXPORTER],
                                    "env": [
                                        {
                                            "name": "POD_IP",
                                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                                        }
                                    ],
                                    "ports": [{"name": "metrics", "containerPort": 9100}],
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                                    "readinessProbe": {"tcpSocket": {"port": "metrics"}, "periodSeconds": 1},
                                }
                            ],
                        },
                    },
                },
            },
        ]
    )
    try:
        with Prometheus(kubeconfig=c.kubeconfig, binary=prometheus_bin) as prom:
            res = prom.wait_for(f'demo_queue_depth{{namespace="{NS}"}}', timeout=90)
            assert res[0]["metric"]["pod"].startswith(APP)
            assert res[0]["metric"]["node"] == "gpu-node-0"
            with PrometheusAdapter(c, prom.url) as adapter:
                items = adapter.wait_for_pod_metric(NS, "demo_queue_depth", timeout=90)
                assert items[0]["value"] == "10"
                # the HPA controller (kube-controller-manager) reads the metric
                # through the aggregated API: avg 10 per pod vs target 5 -> 2 replicas
                c.apply(
                    {
                        "apiVersion": "autoscaling/v2",
                        "kind": "HorizontalPodAutoscaler",
                        "metadata": {"name": APP, "namespace": NS},
                        "spec": {
                            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP},
                            "minReplicas": 1,
                            "maxReplicas": 2,
                            "metrics": [
                                {
                                    "type": "Pods",
                                    "pods": {
                                        "metric": {"name": "demo_queue_depth"},
                                        "target": {"type": "AverageValue", "averageValue": "5"},
                                    },
                                }
                            ],
                        },
                    }
                )

                def scaled():
                    d = json.loads(c.kubectl("get", "deployment", APP, "-n", NS, "-o", "json").stdout)
                    return d["spec"]["replicas"] == 2 and d["status"].get("readyReplicas") == 2

                _wait(scaled, timeout=180, what="HPA scaling the deployment to 2 ready replicas")
                hpa = json.loads(c.kubectl("get", "hpa", APP, "-n", NS, "-o", "json").stdout)
                cur = hpa["status"]["currentMetrics"][0]["pods"]["current"]["averageValue"]
                assert cur == "10", hpa["status"]
                assert len(pod_runner.running(NS)) == 2
    finally:
        c.kubectl("delete", "namespace", NS, "--wait=false", check=False)
