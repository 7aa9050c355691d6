"""Renderers of an InferenceServer: every spec field lands in the right place of the Deployment, Services,
claim, HPA and ServiceMonitor."""

from __future__ import annotations

import copy

import pytest

from naiad_operator.config import OperatorConfig
from naiad_operator.metrics_resources import render_server_hpa, render_service_monitor
from naiad_operator.naming import MODELS_READY_CONDITION, SERVER_LABEL, SERVICE_ROLE_LABEL
from naiad_operator.ownership import Owner
from naiad_operator.pool_resources import (
    PRE_STOP_SLEEP_SECONDS,
    render_claim,
    render_deployment,
    render_headless_service,
    render_pool,
    render_pool_service,
)
from naiad_operator.server_spec import autoscaling_active, desired_replicas, server_args, server_spec_problems

OWNER = Owner("naiad.dev/v1alpha1", "InferenceServer", "gpu-pool", "uid-1", "ml")
CONFIG = OperatorConfig(server_image="registry.example/naiad:1", queue_metric_name="queue_us")

FULL_SPEC = {
    "image": "registry.example/naiad:2",
    "imagePullPolicy": "Always",
    "imagePullSecrets": [{"name": "pull"}],
    "args": ["--log-verbose=1", "--exit-timeout-secs=5"],
    "env": [
        {"name": "OMP_NUM_THREADS", "value": "4"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
    ],
    "replicas": 3,
    "minReplicas": 2,
    "maxReplicas": 6,
    "autoscaling": {
        "targetQueueTimeMicroseconds": 5000,
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
    },
    "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"}, "requests": {"cpu": "4"}},
    "nodeSelector": {"gpu": "a100"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
    ],
    "runtimeClassName": "nvidia",
    "priorityClassName": "inference",
    "serviceAccountName": "naiad-server",
    "podLabels": {"team": "vision", SERVER_LABEL: "spoofed"},
    "podAnnotations": {"sidecar.istio.io/inject": "false"},
    "shmSize": "2Gi",
    "modelRepository": {"claimName": "models", "subPath": "prod/", "path": "/models"},
    "probes": {
        "startup": {"failureThreshold": 120},
        "readiness": {"periodSeconds": 2},
        "liveness": {"timeoutSeconds": 9},
    },
    "service": {"type": "LoadBalancer", "annotations": {"lb": "internal"}},
    "capabilities": {"backends": ["onnxruntime"]},
    "capacity": {"maxModels": 4, "memory": "20Gi"},
    "monitoring": {"serviceMonitor": True, "interval": "30s"},
}


def deployment(spec=None, config=CONFIG):
    return render_deployment(OWNER, FULL_SPEC if spec is None else spec, config)


def container(spec=None):
    return deployment(spec)["spec"]["template"]["spec"]["containers"][0]


def test_deployment_identity_and_ownership():
    d = deployment()
    assert d["apiVersion"] == "apps/v1" and d["kind"] == "Deployment"
    assert d["metadata"]["name"] == "gpu-pool" and d["metadata"]["namespace"] == "ml"
    assert d["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "naiad.dev/v1alpha1",
            "kind": "InferenceServer",
            "name": "gpu-pool",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert d["spec"]["selector"] == {"matchLabels": {SERVER_LABEL: "gpu-pool"}}
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_replicas_are_clamped_to_min_and_max():
    assert deployment()["spec"]["replicas"] == 3
    assert desired_replicas({"replicas": 1, "minReplicas": 2}) == 2
    assert desired_replicas({"replicas": 9, "maxReplicas": 6}) == 6
    assert desired_replicas({}) == 1
    assert desired_replicas({"replicas": 0}) == 0


def test_container_image_command_and_explicit_model_control():
    c = container()
    assert c["name"] == "server"
    assert c["image"] == "registry.example/naiad:2"
    assert c["imagePullPolicy"] == "Always"
    assert c["command"] == ["naiad"]
    assert c["args"] == [
        "serve",
        "--model-repository=/models",
        "--model-control-mode=explicit",
        "--strict-readiness=false",
        "--http-port=8000",
        "--grpc-port=8001",
        "--metrics-port=8002",
        "--drain-quiet-secs=2",  # listens on after the preStop sleep while connections still arrive
        "--frontend-workers=3",  # from the pod's CPU request, less the engine's
        "--log-verbose=1",
        "--exit-timeout-secs=5",
    ]
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [
        ("http", 8000),
        ("grpc", 8001),
        ("metrics", 8002),
    ]


def test_operator_defaults_fill_image_and_pull_policy():
    c = container({})
    assert c["image"] == "registry.example/naiad:1"
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert "env" not in c and "resources" not in c and "volumeMounts" not in c


def test_env_and_resources_are_copied():
    c = container()
    assert c["env"] == FULL_SPEC["env"]
    assert c["resources"] == FULL_SPEC["resources"]
    assert c["env"] is not FULL_SPEC["env"]  # a copy: rendering never aliases the spec


def test_probes_use_health_endpoints_and_overrides():
    c = container()
    assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["startupProbe"]["failureThreshold"] == 120
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["readinessProbe"]["periodSeconds"] == 2
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["livenessProbe"]["timeoutSeconds"] == 9
    assert c["livenessProbe"]["periodSeconds"] == 10  # default kept


def test_a_deleted_pod_keeps_serving_while_the_service_forgets_it():
    """preStop sleeps (the kubelet's sleep action) before SIGTERM, and the grace period covers it and the drain."""
    deployment = render_deployment(OWNER, {"replicas": 1}, CONFIG)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_SECONDS}}}
    assert (
        pod["terminationGracePeriodSeconds"] >= PRE_STOP_SLEEP_SECONDS + 30
    )  # the server's --exit-timeout-secs
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_repository_volume_is_read_only_with_sub_path_and_shm():
    d = deployment()
    pod = d["spec"]["template"]["spec"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod[
        "volumes"
    ]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True, "subPath": "prod"} in mounts
    assert {"name": "dshm", "mountPath": "/dev/shm"} in mounts


def test_created_claim_is_mounted_and_rendered():
    spec = {
        "modelRepository": {
            "create": {"size": "50Gi", "storageClassName": "fast", "accessModes": ["ReadWriteMany"]},
            "path": "/repo",
        }
    }
    pod = deployment(spec)["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "gpu-pool-models"
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/repo"
    assert "--model-repository=/repo" in pod["containers"][0]["args"]
    claim = render_claim(OWNER, spec)
    assert claim["metadata"]["name"] == "gpu-pool-models"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "50Gi"}},
        "storageClassName": "fast",
    }


def test_retained_claim_has_no_owner_and_no_claim_without_create():
    claim = render_claim(OWNER, {"modelRepository": {"create": {"size": "1Gi", "retain": True}}})
    assert "ownerReferences" not in claim["metadata"]
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert render_claim(OWNER, FULL_SPEC) is None


def test_scheduling_fields_reach_the_pod_spec():
    pod = deployment()["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "a100"}
    assert pod["affinity"] == FULL_SPEC["affinity"]
    assert pod["topologySpreadConstraints"] == FULL_SPEC["topologySpreadConstraints"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["priorityClassName"] == "inference"
    assert pod["serviceAccountName"] == "naiad-server"
    assert pod["imagePullSecrets"] == [{"name": "pull"}]
    assert pod["readinessGates"] == [{"conditionType": MODELS_READY_CONDITION}]
    assert pod["automountServiceAccountToken"] is False


def test_gpu_pods_tolerate_the_gpu_taint_unless_user_covers_it():
    pod = deployment()["spec"]["template"]["spec"]
    assert pod["tolerations"] == [
        FULL_SPEC["tolerations"][0],
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    own = {
        "resources": {"limits": {"nvidia.com/gpu": "2"}},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "a100"}],
    }
    assert deployment(own)["spec"]["template"]["spec"]["tolerations"] == own["tolerations"]
    assert (
        "tolerations" not in deployment({"resources": {"limits": {"cpu": "2"}}})["spec"]["template"]["spec"]
    )


def test_pod_labels_and_annotations_merge_with_ours_winning():
    template = deployment()["spec"]["template"]["metadata"]
    assert template["labels"]["team"] == "vision"
    assert template["labels"][SERVER_LABEL] == "gpu-pool"  # the selector label cannot be overridden
    assert template["annotations"]["sidecar.istio.io/inject"] == "false"
    assert template["annotations"]["prometheus.io/port"] == "8002"
    assert template["annotations"]["kubectl.kubernetes.io/default-container"] == "server"


def test_security_context_is_non_root():
    d = deployment()
    assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # the image's group owns Secret volumes (the TLS key is 0440), so the non-root server can read them
    assert d["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001
    sc = d["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True}


def test_pool_service_and_headless_service():
    svc = render_pool_service(OWNER, FULL_SPEC)
    assert svc["metadata"]["name"] == "gpu-pool"
    assert svc["metadata"]["annotations"] == {"lb": "internal"}
    assert svc["metadata"]["labels"][SERVICE_ROLE_LABEL] == "pool"
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["selector"] == {SERVER_LABEL: "gpu-pool"}
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [
        ("http", 8000),
        ("grpc", 8001),
        ("metrics", 8002),
    ]
    headless = render_headless_service(OWNER)
    assert headless["metadata"]["name"] == "gpu-pool-headless"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == {SERVER_LABEL: "gpu-pool"}
    assert [p["name"] for p in headless["spec"]["ports"]] == ["http", "grpc"]
    assert render_pool_service(OWNER, {})["spec"]["type"] == "ClusterIP"


def test_hpa_targets_the_inference_server_scale_subresource_with_the_queue_metric():
    hpa = render_server_hpa(OWNER, FULL_SPEC, CONFIG)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "naiad.dev/v1alpha1",
        "kind": "InferenceServer",
        "name": "gpu-pool",
    }
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 6
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "queue_us"},
                "target": {"type": "AverageValue", "averageValue": "5000"},
            },
        }
    ]
    assert hpa["spec"]["behavior"] == FULL_SPEC["autoscaling"]["behavior"]


def test_hpa_custom_metrics_replace_the_default():
    spec = copy.deepcopy(FULL_SPEC)
    spec["autoscaling"]["metrics"] = [
        {
            "type": "Resource",
            "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}},
        }
    ]
    assert render_server_hpa(OWNER, spec, CONFIG)["spec"]["metrics"] == spec["autoscaling"]["metrics"]


def test_autoscaling_is_active_only_with_a_range_and_not_disabled():
    assert autoscaling_active({"maxReplicas": 3})
    assert not autoscaling_active({"maxReplicas": 1})
    assert not autoscaling_active({"minReplicas": 3, "maxReplicas": 3})
    assert not autoscaling_active({"maxReplicas": 3, "autoscaling": {"enabled": False}})
    assert not autoscaling_active({"replicas": 3})
    assert render_server_hpa(OWNER, {"replicas": 2}, CONFIG) is None


def test_service_monitor_selects_only_the_pool_service():
    sm = render_service_monitor(OWNER, FULL_SPEC)
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"] == {SERVER_LABEL: "gpu-pool", SERVICE_ROLE_LABEL: "pool"}
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}


def test_render_pool_lists_children_and_the_ones_to_remove():
    objects = render_pool(OWNER, FULL_SPEC, CONFIG, monitoring_api=True)
    assert [o["kind"] for o in objects.apply] == [
        "Deployment",
        "Service",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
    ]
    assert objects.absent == [("networking.k8s.io/v1", "NetworkPolicy", "gpu-pool")]
    plain = render_pool(
        OWNER,
        {"monitoring": {"serviceMonitor": False}, "disruptionBudget": {"enabled": False}},
        CONFIG,
        monitoring_api=True,
    )
    assert [o["kind"] for o in plain.apply] == ["Deployment", "Service", "Service"]
    assert plain.absent == [
        ("policy/v1", "PodDisruptionBudget", "gpu-pool"),
        ("autoscaling/v2", "HorizontalPodAutoscaler", "gpu-pool"),
        ("monitoring.coreos.com/v1", "ServiceMonitor", "gpu-pool"),
        ("networking.k8s.io/v1", "NetworkPolicy", "gpu-pool"),
    ]
    no_api = render_pool(OWNER, {}, CONFIG, monitoring_api=False)
    assert ("monitoring.coreos.com/v1", "ServiceMonitor", "gpu-pool") not in no_api.absent
    off = render_pool(OWNER, {}, OperatorConfig(service_monitors="false"), monitoring_api=True)
    assert all(o["kind"] != "ServiceMonitor" for o in off.apply)
    with_claim = render_pool(OWNER, {"modelRepository": {"create": {"size": "1Gi"}}}, CONFIG, False)
    assert with_claim.apply[0]["kind"] == "PersistentVolumeClaim"


def test_disruption_budget_per_pool_with_configurable_max_unavailable():
    (budget,) = [o for o in render_pool(OWNER, {}, CONFIG, False).apply if o["kind"] == "PodDisruptionBudget"]
    assert budget["apiVersion"] == "policy/v1"
    assert budget["metadata"]["name"] == "gpu-pool"
    assert budget["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == {"matchLabels": {SERVER_LABEL: "gpu-pool"}}
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    spec = {"disruptionBudget": {"maxUnavailable": "25%"}}
    (budget,) = [
        o for o in render_pool(OWNER, spec, CONFIG, False).apply if o["kind"] == "PodDisruptionBudget"
    ]
    assert budget["spec"]["maxUnavailable"] == "25%"
    assert server_spec_problems("gpu-pool", spec) == []
    for bad in ("half", -1, "x%"):
        problems = server_spec_problems("gpu-pool", {"disruptionBudget": {"maxUnavailable": bad}})
        assert any("disruptionBudget.maxUnavailable" in p for p in problems), bad


def test_pods_spread_over_nodes_by_default_and_the_spec_overrides_it():
    (spread,) = deployment({})["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"] == {"matchLabels": {SERVER_LABEL: "gpu-pool"}}
    assert spread["matchLabelKeys"] == ["pod-template-hash"]
    own = deployment()["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert own == FULL_SPEC["topologySpreadConstraints"]
    off = deployment({"topologySpreadConstraints": []})["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in off


@pytest.mark.parametrize(
    "arg",
    [
        "--strict-readiness=true",
        "--model-control-mode=poll",
        "--http-port=9000",
        "--model-repository=/x",
        "--grpc-port",
        "--metrics-port=1",
    ],
)
def test_reserved_flags_are_reported(arg):
    problems = server_spec_problems("pool", {"args": [arg]})
    assert len(problems) == 1 and arg.split("=")[0] in problems[0]


def test_spec_problems():
    assert server_spec_problems("pool", FULL_SPEC) == []
    assert "minReplicas (5) exceeds maxReplicas (2)" in server_spec_problems(
        "pool", {"minReplicas": 5, "maxReplicas": 2}
    )
    assert any("DNS-1035" in p for p in server_spec_problems("Pool.A", {}))
    assert any("longer than" in p for p in server_spec_problems("p" * 60, {}))
    assert any("capacity.memory" in p for p in server_spec_problems("pool", {"capacity": {"memory": "lots"}}))


def test_server_args_keep_user_flags_last():
    assert server_args({"args": ["--log-verbose=1"]})[-1] == "--log-verbose=1"
