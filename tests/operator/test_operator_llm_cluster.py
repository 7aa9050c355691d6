"""LLM InferenceModels on the real control plane: a llama.cpp model (a tiny GGUF on a volume the pods read) with
`spec.llm` reaches Available on its dedicated pool, reports its copy's queue and KV-cache use in status, answers
`/v1/chat/completions` through its Service's `openai` port, gets an InferencePool (the Gateway API Inference
Extension's CRD, installed from its Go module by tools/gie/crds.sh) and an HPA on requests waiting.

The Gateway API Inference Extension's own endpoint picker (v1.5.0's cmd/epp, built from its Go module by
tools/go/build.sh gie-epp) then routes over two copies by Naiad's gauges, asked through its ext-proc gRPC interface
as Envoy asks it (tools/go/gie-epp/extproc-client): least queue, and prefix affinity.

Same harness as test_operator_cluster.py (its own cluster). Run: pytest tests/operator/test_operator_llm_cluster.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
from test_operator_cluster import (  # noqa: F401 (fixtures)
    IMAGE_MODE,
    NS,
    ROOT,
    adapter_rules,
    harness,
    model,
    report,
    wait,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Looked up, not imported: importing it (numpy's BLAS) starts threads, and the cluster must start in a process
# without any (e2e/podnet.py moves it into a network namespace of its own).
if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip(
        "llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)", allow_module_level=True
    )

LLM = "tiny_llm"
# The operator's default image for llamacpp models (Dockerfile.llm): the pods run from it in image mode.
LLM_SERVER_IMAGE = "ghcr.io/naiad-dev/naiad-server:0.1.0-llm"


def gie_crds() -> str:
    """The InferencePool CRD directory (fetched once from the module proxy, then cached)."""
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/local/go/bin"}
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "gie" / "crds.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if result.returncode != 0:
        pytest.skip(f"the Gateway API Inference Extension's CRDs are not available: {result.stderr[-500:]}")
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def prebuilt() -> tuple[str, str | None]:
    """The InferencePool CRDs and the endpoint picker's bin directory (None: not built), had before the harness
    starts: the cluster may move this process into a network namespace of its own, off the network."""
    return gie_crds(), epp_tools()


@pytest.fixture(scope="module")
def llm_repo(harness):  # noqa: F811
    """The tiny GGUF in the repository the pods read (file://), with one-thread, two-slot engine settings."""
    from llm_models import write_tiny_gguf  # imported after the cluster started (numpy starts threads)

    write_tiny_gguf(harness.repo / LLM / "1" / "model.gguf")
    (harness.repo / LLM / "config.pbtxt").write_text(
        'backend: "llamacpp"\n'
        'parameters { key: "n_parallel" value: { string_value: "2" } }\n'
        'parameters { key: "n_threads" value: { string_value: "1" } }\n'
    )
    if IMAGE_MODE:
        harness.runner.images.get(LLM_SERVER_IMAGE)  # unpacked up front, not inside a pod's start
    return harness.repo


def stream_until(stop: threading.Event, ips: list[str], body: dict) -> None:
    """Streamed `/v1/completions` one after another, read to the end, until `stop` is set; each at the next of the
    pod IPs in `ips` (a list another thread may update; empty: wait)."""
    turn = 0
    while not stop.is_set():
        if not ips:
            stop.wait(0.1)
            continue
        turn += 1
        request = urllib.request.Request(
            f"http://{ips[turn % len(ips)]}:8000/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                for _ in response:
                    if stop.is_set():
                        break
        except OSError:
            stop.wait(0.1)


def post_json(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def test_llm_model_serves_openai_through_its_service_with_an_inference_pool(prebuilt, llm_repo, report):  # noqa: F811
    h = report
    crds, _ = prebuilt
    h.kubectl("apply", "--server-side", "-f", crds)
    h.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/inferencepools.inference.networking.k8s.io",
        "--timeout=60s",
    )
    h.apply(
        model(
            "llama",
            modelName=LLM,
            storage={"uri": f"file://{h.repo}"},
            llm={"engine": "llamacpp", "parallelism": {"tensor": 1, "pipeline": 1}},
            minReplicas=1,
            maxReplicas=2,
            server={"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}]},
        )
    )
    server = wait(lambda: h.get("inferenceserver", "llama-server"), 60, what="dedicated InferenceServer")
    # one copy = tensor x pipeline GPUs on one pod; the pods carry the label the endpoint picker reads
    assert server["spec"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert server["spec"]["podLabels"]["inference.networking.k8s.io/engine-type"] == "vllm"
    status = wait(
        lambda: (s := h.model_status("llama")).get("phase") == "Available" and s, 240, what="LLM Available"
    )
    assert status["endpoint"]["openai"] == f"http://llama.{NS}.svc:80/v1"
    (holder,) = h.get("pods", selector="naiad.dev/server=llama-server,naiad.dev/model-llama=loaded")["items"]
    assert holder["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "vllm"
    assert holder["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert holder["spec"]["containers"][0]["image"] == LLM_SERVER_IMAGE  # llama.cpp is in the LLM image only
    if IMAGE_MODE:  # and the pod runs from it, not from this virtualenv
        procs = [p for p in h.runner.processes() if p.pod == holder["metadata"]["name"]]
        assert procs and all(p.image_id for p in procs), procs
    # status.copies: the operator read the engine's gauges from the pod's metrics port
    copies = wait(
        lambda: (c := h.model_status("llama").get("copies")) and "requestsWaiting" in c[0] and c,
        60,
        what="status.copies with gauges",
    )
    assert copies[0]["pod"] == holder["metadata"]["name"]
    assert copies[0]["requestsWaiting"] == 0 and 0 <= copies[0]["kvCacheUsagePercent"] <= 100

    # the Service's openai port: its EndpointSlice maps it to the pod's HTTP port (no kube-proxy here, so the
    # client goes to the endpoint the Service resolves to, as a proxy would)
    service = h.get("service", "llama")
    assert {"name": "openai", "port": 80, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"} in (
        service["spec"]["ports"]
    )
    ip = holder["status"]["podIP"]
    wait(lambda: h.endpoints("llama") == {ip}, 60, what="LLM Service endpoints")
    slices = h.get("endpointslices", selector="kubernetes.io/service-name=llama")["items"]
    ports = {p["name"]: p["port"] for s in slices for p in s.get("ports") or []}
    assert ports["openai"] == 8000
    code, body = post_json(
        f"http://{ip}:{ports['openai']}/v1/chat/completions",
        {"model": LLM, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0},
    )
    assert code == 200, body
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1
    code, body = post_json(f"http://{ip}:8000/v1/chat/completions", {"model": "nope", "messages": []})
    assert code in (400, 404) and "error" in body

    # the InferencePool the Gateway API Inference Extension routes by
    pool = wait(lambda: h.get("inferencepool", "llama"), 60, what="InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"] == {
        "naiad.dev/server": "llama-server",
        "naiad.dev/model-llama": "loaded",
    }
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "llama-epp"
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "InferenceModel"
    # the HPA scales the model on its engine's waiting requests per pod
    hpa = wait(lambda: h.get("hpa", "llama"), 60, what="HPA")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"] == {
        "name": "naiad_llm_requests_waiting",
        "selector": {"matchLabels": {"model_name": LLM}},
    }
    # turning the InferencePool off removes it
    h.kubectl(
        "-n",
        NS,
        "patch",
        "im",
        "llama",
        "--type=merge",
        "-p",
        '{"spec":{"llm":{"inferencePool":{"enabled":false}}}}',
    )
    wait(lambda: not h.exists("inferencepool", "llama"), 60, what="InferencePool removed")
    h.kubectl("-n", NS, "delete", "im", "llama", "--timeout=90s")


def test_hpa_scales_an_llm_on_requests_waiting(llm_repo, report):  # noqa: F811
    """Prometheus scrapes the engine's vllm:num_requests_waiting, prometheus-adapter serves it with the chart's
    rule, and the real HPA controller scales the model to 2 copies while more clients stream than the engine has
    slots, and back to 1 when they stop."""
    h = report
    monitoring = pytest.importorskip("e2e.monitoring")
    if not monitoring.find_prometheus():
        pytest.skip("prometheus binary missing (apt-get install prometheus)")
    h.apply(
        model(
            "chat",
            modelName=LLM,
            storage={"uri": f"file://{h.repo}"},
            llm={"engine": "llamacpp"},
            replicas=1,
            minReplicas=1,
            maxReplicas=2,
            autoscaling={
                "targetRequestsWaiting": 1,
                "behavior": {
                    "scaleUp": {"stabilizationWindowSeconds": 0},
                    "scaleDown": {"stabilizationWindowSeconds": 0},
                },
            },
            server={"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}]},
        )
    )
    wait(lambda: h.model_status("chat").get("phase") == "Available", 240, what="chat Available")
    stop = threading.Event()
    # the copies' IPs, re-read by one thread: a kubectl call before each request (as this test made before) kept
    # each client busy most of the time, and on a quiet machine the queue the HPA scales on seldom formed
    ips: list[str] = []

    def watch_copies() -> None:
        while not stop.is_set():
            try:
                found = h.get("pods", selector="naiad.dev/model-chat=loaded")["items"]
                ips[:] = [p["status"]["podIP"] for p in found if p["status"].get("podIP")]
            except Exception:  # a slow API server: keep the last list
                pass
            stop.wait(1)

    workers = [threading.Thread(target=watch_copies, daemon=True)]
    # long streams, more at once than the two slots: the rest wait in the engine's queue
    body = {"model": LLM, "prompt": "once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    workers += [threading.Thread(target=stream_until, args=(stop, ips, body), daemon=True) for _ in range(8)]
    prometheus = monitoring.Prometheus(kubeconfig=h.cluster.kubeconfig, workdir=h.workdir / "llm-prometheus")
    adapter = monitoring.PrometheusAdapter(
        h.cluster, "", rules=adapter_rules(h), workdir=h.workdir / "llm-adapter"
    )
    try:
        prometheus.start()
        adapter.prometheus_url = prometheus.url
        adapter.start()
        for worker in workers:
            worker.start()
        metric = "naiad_llm_requests_waiting"
        items = wait(
            lambda: [i for i in adapter.pod_metric(NS, metric) if float(i["value"].rstrip("m") or 0) > 0],
            120,
            what=f"custom metric {metric} above 0",
        )
        assert items[0]["describedObject"]["name"].startswith("chat-server-")
        wait(lambda: h.get("inferencemodel", "chat")["spec"]["replicas"] == 2, 240, what="scaled to 2")
        wait(lambda: h.model_status("chat").get("availableReplicas") == 2, 180, what="2 copies")
        copies = h.model_status("chat")["copies"]
        assert len(copies) == 2
        stop.set()
        for worker in workers:
            worker.join(timeout=130)
        wait(lambda: h.get("inferencemodel", "chat")["spec"]["replicas"] == 1, 240, what="scaled back to 1")
        hpa = h.get("hpa", "chat")
        conditions = {c["type"]: c["status"] for c in hpa["status"]["conditions"]}
        assert conditions["ScalingActive"] == "True", hpa["status"]
    except BaseException:
        adapter_log = adapter.log_path.read_text()[-3000:] if adapter.log_path.exists() else ""
        print(h.diagnostics(), f"--- adapter ---\n{adapter_log}")
        raise
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=15)
        adapter.stop()
        prometheus.stop()
        h.kubectl("-n", NS, "delete", "im", "chat", "--timeout=90s", check=False)


# --- the Gateway API Inference Extension's endpoint picker --------------------------------------------------------


def epp_tools() -> str | None:
    """The endpoint picker (GIE v1.5.0's cmd/epp) and the ext-proc client, built once by tools/go/build.sh."""
    from helpers import go_tool

    epp = go_tool("gie-epp", "epp")
    if epp is None or not (epp.parent / "extproc-client").exists():
        return None
    return str(epp.parent)


class EndpointPicker:
    """GIE's EPP as a local process, watching the cluster with the admin kubeconfig, for one InferencePool."""

    def __init__(self, bin_dir: str, kubeconfig: str, pool: str, log_path):
        from test_operator_cluster import free_port

        self.bin_dir = bin_dir
        self.port, health, metrics = free_port(), free_port(), free_port()
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [
                    f"{bin_dir}/epp",
                    f"--pool-name={pool}",
                    f"--pool-namespace={NS}",
                    f"--grpc-port={self.port}",
                    f"--grpc-health-port={health}",
                    f"--metrics-port={metrics}",
                    "--secure-serving=false",
                    "--model-server-metrics-port=8002",  # Naiad serves its metrics on their own port
                    "--refresh-metrics-interval=100ms",
                    "--v=2",
                ],
                env={**os.environ, "KUBECONFIG": kubeconfig},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def pick(self, prompt: str) -> str:
        """The pod IP the picker sends this /v1/completions request to, asked as Envoy asks it."""
        body = json.dumps({"model": LLM, "prompt": prompt, "max_tokens": 8})
        result = subprocess.run(
            [f"{self.bin_dir}/extproc-client", f"--picker=127.0.0.1:{self.port}", f"--body={body}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if result.returncode != 0:  # a ValueError: wait() retries it while the picker starts
            raise ValueError(result.stderr[-1000:])
        return json.loads(result.stdout)["endpoint"].rsplit(":", 1)[0]

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_endpoint_picker_routes_by_naiads_gauges(prebuilt, llm_repo, report):  # noqa: F811
    """The real endpoint picker reads the InferencePool the operator rendered and the pods' vllm:* gauges: with one
    pod's engine queue full it sends every new request to the other pod, and with both idle it sends a prompt
    that extends an earlier one to the pod it sent the earlier one to (prefix affinity)."""
    h = report
    crds, epp_bin = prebuilt
    if epp_bin is None:
        pytest.skip("the endpoint picker is not built (make tools; tools/go/build.sh gie-epp)")
    h.kubectl("apply", "--server-side", "-f", crds)
    h.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/inferencepools.inference.networking.k8s.io",
        "--timeout=60s",
    )
    h.apply(
        model(
            "routed",
            modelName=LLM,
            storage={"uri": f"file://{h.repo}"},
            llm={"engine": "llamacpp"},
            replicas=2,
            server={"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}]},
        )
    )
    wait(lambda: h.model_status("routed").get("availableReplicas") == 2, 300, what="2 copies Available")
    wait(lambda: h.get("inferencepool", "routed"), 60, what="InferencePool")
    ips = sorted(
        p["status"]["podIP"] for p in h.get("pods", selector="naiad.dev/model-routed=loaded")["items"]
    )
    busy, idle = ips
    picker = EndpointPicker(epp_bin, h.cluster.kubeconfig, "routed", h.workdir / "epp.log")
    stop = threading.Event()

    # long streams at one pod: its two slots run, the rest wait in its queue
    body = {"model": LLM, "prompt": "busy", "max_tokens": 400, "ignore_eos": True, "stream": True}
    workers = [
        threading.Thread(target=stream_until, args=(stop, [busy], body), daemon=True) for _ in range(6)
    ]
    try:
        # the picker knows both pods
        wait(
            lambda: len({picker.pick(f"warm-up {i} " * 3) for i in range(8)}) == 2,
            60,
            what="picker sees 2 pods",
        )
        for worker in workers:
            worker.start()
        wait(
            lambda: any(
                c.get("requestsWaiting", 0) >= 2 for c in h.model_status("routed").get("copies") or []
            ),
            60,
            what="a queue on the busy pod",
        )
        picks = [picker.pick(f"fresh question number {i}: what is {i} times {i}?") for i in range(10)]
        assert picks == [idle] * 10, (picks, busy, idle)
        stop.set()
        for worker in workers:
            worker.join(timeout=130)
        wait(
            lambda: all(
                c.get("requestsWaiting", 1) == 0 for c in h.model_status("routed").get("copies") or [{}]
            ),
            120,
            what="both queues empty",
        )
        # both idle: a prompt that extends an earlier one goes where the earlier one went
        stories = [f"Story {i}: " + " ".join(f"word{i}x{j}" for j in range(120)) for i in range(6)]
        first = [picker.pick(story) for story in stories]
        again = [picker.pick(story + " and then the end.") for story in stories]
        assert again == first, (first, again)
    except BaseException:
        print(h.diagnostics(), f"--- epp ---\n{picker.log()}")
        raise
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=15)
        picker.stop()
        h.kubectl("-n", NS, "delete", "im", "routed", "--timeout=90s", check=False)
