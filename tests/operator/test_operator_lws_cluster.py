"""An LLM InferenceModel larger than a node on the real control plane: the operator renders a LeaderWorkerSet, the
real LWS controller (sigs.k8s.io/lws v0.7.0 built from its Go module by tools/go/build.sh lws, run as a local
process with its webhooks served on 127.0.0.1: e2e/lws.py) creates the group's leader and worker pods with their
LWS_* variables and labels and the group's headless Service, the model's Service selects the leader only, and a
worker that goes away takes its whole group with it (RecreateGroupOnPodRestart).

The pod runner runs the pods for real: the worker is llama.cpp's rpc-server on its pod IP (ready once it accepts
connections), the leader `naiad serve` with the model and $NAIAD_LLAMACPP_RPC_SERVERS naming the worker by its
headless-Service DNS name, which it resolves through e2e/poddns.py (the group's names in a hosts file, standing in
for CoreDNS); the leader loads the model with its layers on the worker and answers a chat completion.

In image mode (NAIAD_E2E_IMAGES=1, `make e2e-llm-image-tests`) both pods run from the LLM server image, the
operator from its image; the hosts file is bound at the containers' /etc/hosts, as the kubelet mounts one.

Same harness as test_operator_cluster.py (its own cluster). Run: pytest tests/operator/test_operator_lws_cluster.py
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_operator_cluster import (  # noqa: F401 (fixtures)
    IMAGE_MODE,
    NS,
    ROOT,
    harness,
    model,
    report,
    wait,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip(
        "llama-cpp-python is built by `make llm-deps` (tools/llama_cpp/build.sh)", allow_module_level=True
    )

LLM = "tiny_llm"
# The operator's default image for llamacpp models (Dockerfile.llm, `make images-llm`): in image mode the leader's
# Naiad and the worker's rpc-server run from it.
LLM_SERVER_IMAGE = "ghcr.io/naiad-dev/naiad-server:0.1.0-llm"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"


@pytest.fixture(scope="module")
def lws_tools():
    """The LWS controller, its manifests and llama.cpp's rpc-server, had before the harness starts (the cluster
    may move this process into a network namespace of its own, off the network)."""
    from e2e import lws

    try:
        binary, manifests = lws.controller_binary(), lws.manifests_dir()
    except (lws.ClusterError, OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"the LeaderWorkerSet controller is not available: {error}")
    servers = subprocess.run(
        ["bash", str(ROOT / "tools" / "llama_cpp" / "build.sh"), "rpc"],
        capture_output=True,
        text=True,
        timeout=3600,
        check=True,
    )
    rpc_server = servers.stdout.strip().splitlines()[-1] + "/bin/rpc-server"
    return binary, manifests, rpc_server


@pytest.fixture(scope="module")
def lws_cluster(lws_tools, harness):  # noqa: F811
    """The harness with the LWS controller running, the tiny GGUF in the repository and rpc-server runnable."""
    from llm_models import write_tiny_gguf  # imported after the cluster started (numpy starts threads)

    from e2e import lws
    from e2e.poddns import PodHosts

    binary, manifests, rpc_server = lws_tools
    write_tiny_gguf(harness.repo / LLM / "1" / "model.gguf")
    (harness.repo / LLM / "config.pbtxt").write_text(
        'backend: "llamacpp"\n'
        'parameters { key: "n_parallel" value: { string_value: "1" } }\n'
        'parameters { key: "n_threads" value: { string_value: "1" } }\n'
        'parameters { key: "rpc_wait_seconds" value: { string_value: "30" } }\n'
    )
    harness.runner.executables["rpc-server"] = rpc_server
    if IMAGE_MODE:
        harness.runner.images.get(LLM_SERVER_IMAGE)  # unpacked up front, not inside a pod's start
    # the leader finds its worker by name, as through CoreDNS: the group's names in a hosts file it sees
    hosts = PodHosts(
        lambda: harness.kubectl("get", "pods", "-A", "-o", "json").stdout, harness.workdir / "pod-hosts"
    )
    naiad = harness.runner.executables.get("naiad")
    if IMAGE_MODE:  # the image's Naiad, with the hosts file where the kubelet mounts a pod's
        harness.runner.image_binds["/etc/hosts"] = str(hosts.path)
    else:
        harness.runner.executables["naiad"] = str(
            hosts.launcher(naiad, harness.workdir / "naiad-with-pod-dns")
        )
        # a vLLM group's pods (naiad.llm.ray_group), from this environment
        harness.runner.executables["naiad-ray-group"] = str(
            hosts.launcher(
                str(Path(sys.executable).parent / "naiad-ray-group"),
                harness.workdir / "ray-group-with-pod-dns",
            )
        )
    controller = lws.LwsController(harness.cluster, harness.workdir / "lws", binary, manifests)
    try:
        hosts.start()
        controller.start()
        yield harness, controller
    finally:
        controller.stop()
        hosts.stop()
        if naiad is not None:
            harness.runner.executables["naiad"] = naiad
        harness.runner.executables.pop("naiad-ray-group", None)
        harness.runner.image_binds.pop("/etc/hosts", None)


def post_json(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def test_a_model_larger_than_a_node_runs_as_a_leader_worker_set(lws_cluster, report):  # noqa: F811
    h, controller = lws_cluster
    try:
        h.apply(
            model(
                "big",
                modelName=LLM,
                storage={"uri": f"file://{h.repo}"},
                llm={"engine": "llamacpp", "parallelism": {"tensor": 1, "pipeline": 2}, "gpusPerNode": 1},
                replicas=1,
                server={"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}]},
            )
        )
        lws = wait(lambda: h.get("leaderworkerset", "big-server"), 60, what="LeaderWorkerSet")
        assert lws["metadata"]["ownerReferences"][0]["kind"] == "InferenceModel"
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert not h.exists("inferenceserver", "big-server")  # no pool: the group is the model's servers

        # the LWS controller made the group: leader big-server-0, worker big-server-0-1, both scheduled (a pod the
        # scheduler has not bound yet has no nodeName: CI listed the worker in that instant once)
        pods = wait(
            lambda: (
                (p := h.get("pods", selector=f"{LWS_NAME}=big-server")["items"])
                and len(p) == 2
                and all(q["spec"].get("nodeName") for q in p)
                and p
            ),
            90,
            what="the group's two pods, scheduled",
        )
        by_name = {p["metadata"]["name"]: p for p in pods}
        assert set(by_name) == {"big-server-0", "big-server-0-1"}
        leader, worker = by_name["big-server-0"], by_name["big-server-0-1"]
        for pod, index, role in ((leader, "0", "leader"), (worker, "1", "worker")):
            labels = pod["metadata"]["labels"]
            assert labels["leaderworkerset.sigs.k8s.io/worker-index"] == index
            assert labels["leaderworkerset.sigs.k8s.io/group-index"] == "0"
            assert labels["naiad.dev/group-role"] == role
            assert pod["spec"]["subdomain"] == "big-server" and pod["spec"]["nodeName"]
            env = env_of(pod["spec"]["containers"][0])
            # injected by the LWS pod webhook
            assert env["LWS_LEADER_ADDRESS"] == f"big-server-0.big-server.{NS}"
            assert env["LWS_GROUP_SIZE"] == "2" and env["LWS_WORKER_INDEX"] == index
            assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        leader_env = env_of(leader["spec"]["containers"][0])
        assert leader_env["NAIAD_LLAMACPP_RPC_SERVERS"] == f"$(POD_NAME)-1.big-server.{NS}:50052"
        assert leader["spec"]["containers"][0]["args"][:3] == [
            "serve",
            f"--load-model={LLM}",
            "--strict-readiness=true",
        ]
        assert worker["spec"]["containers"][0]["command"] == ["rpc-server"]

        # the workers' rpc-server admits only the model's group pods (accepted by the real API server, and its
        # selectors match the real pods' labels: the worker's, not the leader's; both as peers)
        policy = wait(
            lambda: h.get("networkpolicy", "big-server-workers"), 60, what="the workers' NetworkPolicy"
        )
        assert policy["metadata"]["ownerReferences"][0]["kind"] == "InferenceModel"

        def selects(selector: dict, pod: dict) -> bool:
            return all(pod["metadata"]["labels"].get(k) == v for k, v in selector["matchLabels"].items())

        (rule,) = policy["spec"]["ingress"]
        assert selects(policy["spec"]["podSelector"], worker) and not selects(
            policy["spec"]["podSelector"], leader
        )
        assert all(selects(rule["from"][0]["podSelector"], p) for p in (leader, worker))

        # the group's headless Service (made by the LWS controller) and the model's Service on the leader only
        headless = h.get("service", "big-server")
        assert headless["spec"]["clusterIP"] == "None"
        service = h.get("service", "big")
        assert service["spec"]["selector"] == {
            LWS_NAME: "big-server",
            "leaderworkerset.sigs.k8s.io/worker-index": "0",
        }
        leader_ip = wait(lambda: h.get("pod", "big-server-0")["status"].get("podIP"), 60, what="leader IP")
        worker_ip = wait(lambda: h.get("pod", "big-server-0-1")["status"].get("podIP"), 60, what="worker IP")
        wait(
            lambda: (
                {
                    a
                    for s in h.get("endpointslices", selector="kubernetes.io/service-name=big")["items"]
                    for e in s.get("endpoints") or []
                    for a in e["addresses"]
                }
                == {leader_ip}
            ),
            60,
            what="the leader as the model Service's only endpoint",
        )
        # the worker runs a real rpc-server on its pod IP: Ready through its TCP probe
        wait(
            lambda: any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in h.get("pod", "big-server-0-1")["status"].get("conditions") or []
            ),
            60,
            what="worker Ready",
        )
        assert worker_ip != leader_ip

        # the leader loaded the model with its layers on the worker's rpc-server, and answers through /v1
        wait(
            lambda: h.endpoints("big") == {leader_ip},
            120,
            what="the leader Ready (model loaded over RPC)",
        )
        code, body = post_json(
            f"http://{leader_ip}:8000/v1/chat/completions",
            {
                "model": LLM,
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        assert code == 200, body
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] >= 1
        # the model's status follows its LeaderWorkerSet (its groups ready)
        status = wait(
            lambda: (s := h.model_status("big")).get("phase") == "Available" and s, 60, what="big Available"
        )
        assert status["availableReplicas"] == 1 and status["selector"] == (
            f"{LWS_NAME}=big-server,leaderworkerset.sigs.k8s.io/worker-index=0"
        )
        assert status["endpoint"]["openai"] == f"http://big.{NS}.svc:80/v1"
        copies = wait(
            lambda: (c := h.model_status("big").get("copies")) and "requestsWaiting" in c[0] and c,
            60,
            what="status.copies with the leader's gauges",
        )
        assert [c["pod"] for c in copies] == ["big-server-0"] and copies[0]["requestsWaiting"] == 0
        if IMAGE_MODE:  # both pods run from the LLM image, not from this host's build
            procs = {p.pod: p for p in h.runner.processes() if p.namespace == NS and p.pod.startswith("big-")}
            assert set(procs) == {"big-server-0", "big-server-0-1"} and all(
                p.image_id for p in procs.values()
            )
            for pod in (leader, worker):
                assert pod["spec"]["containers"][0]["image"] == LLM_SERVER_IMAGE
        worker_log = h.runner.logs(NS, "big-server-0-1")
        assert "Accepted client connection" in worker_log
        print(
            f"leader {leader_ip} answered {body['choices'][0]['message']!r}; worker {worker_ip}: {worker_log[-300:]!r}"
        )

        # a worker that goes away takes the group with it: the leader is recreated too
        leader_uid = leader["metadata"]["uid"]
        h.kubectl("-n", NS, "delete", "pod", "big-server-0-1", "--wait=false")
        wait(
            lambda: h.get("pod", "big-server-0")["metadata"]["uid"] != leader_uid,
            90,
            what="the group recreated",
        )
        wait(
            lambda: len(h.get("pods", selector=f"{LWS_NAME}=big-server")["items"]) == 2,
            90,
            what="the group's two pods again",
        )
    except BaseException:
        print(f"--- lws-controller ---\n{controller.log()}")
        raise
    finally:
        h.kubectl("-n", NS, "delete", "im", "big", "--timeout=90s", check=False)


VLLM = "group_vllm"
TRITON_VLLM = "group_triton_vllm"
UPSTREAM_VLLM_BACKEND = ROOT / "tests" / "third_party" / "vllm_backend" / "src"


def test_a_vllm_copy_larger_than_a_node_joins_its_group_with_ray(lws_cluster, report):  # noqa: F811
    """engine: vllm, tensor 2 x pipeline 2 on nodes of 2 GPUs: the LWS controller makes a group of two pods from
    the operator's resource; the worker pod's Ray node joins the leader pod's head (found by the LWS_LEADER_ADDRESS
    the controller injected), the leader's server starts once both are alive and loads the model with Ray's
    executor, and the engine (the vllm stand-in, which joins the Ray cluster and counts its GPUs as vLLM's Ray
    executor does; no vLLM runs without a CUDA GPU) sees both pods' 4 GPUs. Real Ray (the test environment's
    `ray`), not in image mode (no image carries vLLM and Ray: the image tier deselects this scenario)."""
    h, _ = lws_cluster
    (h.repo / VLLM / "1").mkdir(parents=True, exist_ok=True)
    (h.repo / VLLM / "config.pbtxt").write_text('backend: "vllm"\n')
    (h.repo / VLLM / "1" / "model.json").write_text('{"model": "stand-in"}')
    log = _ray_group_serves(lws_cluster, "bigv", VLLM, "vllm", [])
    assert "tensor_parallel_size=2 pipeline_parallel_size=2" in log


def test_a_triton_llm_repository_larger_than_a_node_joins_its_group_with_ray(lws_cluster, report):  # noqa: F811
    """engine: triton, the same group as engine: vllm, for a Triton LLM repository: Triton's own vllm_backend
    model.py (unmodified, tests/third_party) as the python-based backend `vllm` in the server's backend directory,
    with model.json asking for tensor 2 x pipeline 2 and Ray's executor itself (the operator loads the model as
    it is). The model.py's engine (the vllm stand-in) runs in the python backend's stub process, which joins the
    group's Ray cluster through the RAY_ADDRESS and Ray token the leader's server was started with."""
    h, _ = lws_cluster
    backends = h.workdir / "triton-backends"
    if not backends.exists():
        shutil.copytree(
            UPSTREAM_VLLM_BACKEND, backends / "vllm", ignore=shutil.ignore_patterns("__pycache__")
        )
    (h.repo / TRITON_VLLM / "1").mkdir(parents=True, exist_ok=True)
    (h.repo / TRITON_VLLM / "config.pbtxt").write_text('backend: "vllm"\n')
    engine = {
        "model": "stand-in",
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "distributed_executor_backend": "ray",
    }
    (h.repo / TRITON_VLLM / "1" / "model.json").write_text(json.dumps(engine))
    _ray_group_serves(lws_cluster, "bigt", TRITON_VLLM, "triton", [f"--backend-directory={backends}"])


def _ray_group_serves(lws_cluster, name: str, model_name: str, engine: str, args: list[str]) -> str:
    """A copy of `model_name` (tensor 2 x pipeline 2 on nodes of 2 GPUs) runs as a Ray group of two pods, loads
    with Ray's executor over both pods' 4 GPUs, answers `generate` from its leader and becomes Available; the
    leader's log."""
    h, controller = lws_cluster
    site = h.workdir / "vllm-site"
    if not site.exists():
        shutil.copytree(ROOT / "tests" / "standins" / "vllm", site / "vllm")
    ray = Path(sys.executable).parent / "ray"
    leader_pod, worker_pod = f"{name}-server-0", f"{name}-server-0-1"
    try:
        h.apply(
            model(
                name,
                modelName=model_name,
                storage={"uri": f"file://{h.repo}"},
                llm={"engine": engine, "parallelism": {"tensor": 2, "pipeline": 2}, "gpusPerNode": 2},
                replicas=1,
                server={
                    "args": args,
                    "env": [
                        {"name": "PYTHONPATH", "value": f"{ROOT / 'server'}:{site}"},
                        {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"},
                    ],
                },
            )
        )
        pods = wait(
            lambda: (p := h.get("pods", selector=f"{LWS_NAME}={name}-server")["items"]) and len(p) == 2 and p,
            90,
            what="the group's two pods",
        )
        by_name = {p["metadata"]["name"]: p for p in pods}
        leader, worker = by_name[leader_pod], by_name[worker_pod]
        assert leader["spec"]["containers"][0]["command"] == ["naiad-ray-group"]
        assert worker["spec"]["containers"][0]["command"] == ["naiad-ray-group"]
        assert (
            env_of(worker["spec"]["containers"][0])["LWS_LEADER_ADDRESS"]
            == f"{leader_pod}.{name}-server.{NS}"
        )
        leader_ip = wait(lambda: h.get("pod", leader_pod)["status"].get("podIP"), 60, what="leader IP")
        wait(
            lambda: h.endpoints(name) == {leader_ip},
            240,
            what="the leader Ready (the group's Ray cluster formed, the model loaded)",
        )
        log = h.runner.logs(NS, leader_pod)
        assert "the group's 2 Ray nodes are alive" in log
        assert "ray executor over 2 nodes with 4 GPUs" in log, log[-3000:]
        code, body = post_json(
            f"http://{leader_ip}:8000/v2/models/{model_name}/generate",
            {"text_input": "a b", "parameters": {"max_tokens": 2}},
        )
        assert code == 200 and body["text_output"] == "a b b a", body
        wait(
            lambda: (s := h.model_status(name)).get("phase") == "Available" and s,
            60,
            what=f"{name} Available",
        )
        print(f"leader {leader_ip}: {log[-600:]!r}")
        return log
    except BaseException:
        print(f"--- lws-controller ---\n{controller.log()}")
        for pod in (leader_pod, worker_pod):
            print(f"--- {pod} ---\n{h.runner.logs(NS, pod)[-4000:]}")
        print(h.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout)
        raise
    finally:
        h.kubectl("-n", NS, "delete", "im", name, "--timeout=90s", check=False)
        try:  # the group's pods gone, then any of their Ray processes still draining (the pods share this host)
            wait(
                lambda: not h.get("pods", selector=f"{LWS_NAME}={name}-server")["items"],
                90,
                what="no group pods",
            )
        finally:
            subprocess.run([str(ray), "stop", "--force"], capture_output=True, timeout=60)
