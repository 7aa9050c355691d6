"""LLM InferenceModels on the real control plane: a llama.cpp model (a tiny GGUF on a volume the pods read) with
`spec.llm` reaches Available on its dedicated pool, reports its copy's queue and KV-cache use in status, answers
`/v1/chat/completions` through its Service's `openai` port, gets an InferencePool (the Gateway API Inference
Extension's CRD, installed from its Go module by tools/gie/crds.sh) and an HPA on requests waiting.

Same harness as test_operator_cluster.py (its own cluster). Run: pytest tests/operator/test_operator_llm_cluster.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import urllib.error
import urllib.request

import pytest
from test_operator_cluster import NS, ROOT, harness, model, report, wait  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Looked up, not imported: importing it (numpy's BLAS) starts threads, and the cluster must start in a process
# without any (e2e/podnet.py moves it into a network namespace of its own).
if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip(
        "llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)", allow_module_level=True
    )

LLM = "tiny_llm"


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
def crds():
    # fetched before the harness starts: the cluster may move this process into a network namespace of its own
    return gie_crds()


def post_json(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def test_llm_model_serves_openai_through_its_service_with_an_inference_pool(crds, report):  # noqa: F811
    h = report
    from llm_models import write_tiny_gguf

    write_tiny_gguf(h.repo / LLM / "1" / "model.gguf")
    (h.repo / LLM / "config.pbtxt").write_text(
        'backend: "llamacpp"\n'
        'parameters { key: "n_parallel" value: { string_value: "2" } }\n'
        'parameters { key: "n_threads" value: { string_value: "1" } }\n'
    )
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
