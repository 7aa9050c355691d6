"""`helm lint` and `helm template` on the chart, when a helm binary is available (skipped otherwise).

helm is found through $NAIAD_HELM, the cluster binaries (`$NAIAD_E2E_BIN/helm`, built by `make cluster-tools`; the
test runs in the cluster tier for that), the e2e cache (~/.cache/naiad-e2e/*/bin/helm), or PATH.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "naiad"


def find_helm() -> str | None:
    bin_dir = os.environ.get("NAIAD_E2E_BIN")
    candidates = [os.environ.get("NAIAD_HELM", ""), os.path.join(bin_dir, "helm") if bin_dir else ""]
    candidates += sorted(glob.glob(os.path.expanduser("~/.cache/naiad-e2e/*/bin/helm")))
    candidates.append(shutil.which("helm") or "")
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


HELM = find_helm()
pytestmark = pytest.mark.skipif(
    HELM is None, reason="no helm binary (set NAIAD_HELM or build the e2e binaries)"
)


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, *args], check=False, capture_output=True, text=True, timeout=120)


def template(*sets: str) -> list[dict]:
    args = ["template", "naiad", str(CHART), "--namespace", "naiad-system", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_lint_is_clean():
    for extra in (
        [],
        [
            "--set",
            "prometheusAdapter.rules.enabled=true,serviceMonitor.enabled=true,grafana.dashboard.enabled=true",
        ],
    ):
        result = helm("lint", "--strict", str(CHART), *extra)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "0 chart(s) failed" in result.stdout


def test_default_render():
    docs = template()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "CustomResourceDefinition",
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRole",
            "ClusterRole",
            "Role",
            "RoleBinding",
            "Deployment",
        ]
    )
    (deployment,) = by_kind(docs, "Deployment")
    # Two replicas with leader election; a rollout never has zero of them.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--leader-elect" in container["args"] and "--leader-elect-lease=naiad" in container["args"]
    assert "--leader-elect-timing=10,7,2" in container["args"]
    (spread,) = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NAIAD_SERVER_IMAGE"] == "ghcr.io/naiad-dev/naiad-server:0.1.0"
    assert env["NAIAD_LLM_SERVER_IMAGE"] == "ghcr.io/naiad-dev/naiad-server:0.1.0-llm"  # Dockerfile.llm
    assert env["NAIAD_NETWORK_POLICY"] == "false"
    namespace = next(e for e in container["env"] if e["name"] == "NAIAD_OPERATOR_NAMESPACE")
    assert namespace["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["NAIAD_QUEUE_METRIC"] == "naiad_queue_time_per_request_us"
    assert env["NAIAD_SERVICE_MONITORS"] == "auto"
    assert env["NAIAD_UNLOAD_DELAY_SECONDS"] == "5"
    assert container["image"] == "ghcr.io/naiad-dev/naiad-operator:0.1.0"
    assert not any(a.startswith("--namespace") for a in container["args"])
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_optional_monitoring_objects():
    docs = template(
        "prometheusAdapter.rules.enabled=true",
        "serviceMonitor.enabled=true",
        "grafana.dashboard.enabled=true",
        "autoscaling.metricName=queue_us",
    )
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["selector"]["matchLabels"]["naiad.dev/service-role"] == "pool"
    config_maps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    rules = yaml.safe_load(config_maps["naiad-prometheus-adapter-rules"]["data"]["config.yaml"])["rules"]
    assert rules[0]["name"]["as"] == "queue_us"
    assert "[1m]" in rules[0]["metricsQuery"]
    dashboard = config_maps["naiad-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["naiad.json"].strip() == (ROOT / "dashboards" / "naiad.json").read_text().strip()
    env = {
        e["name"]: e.get("value")
        for e in by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["NAIAD_SERVICE_MONITORS"] == "false"  # the chart-wide ServiceMonitor replaces per-pool ones


def test_namespace_scoped_rbac():
    docs = template(
        "rbac.scope=namespace", "watchNamespaces={ml,team-a}", "rbac.aggregateToDefaultRoles=false"
    )
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    # a Role per watched namespace; in the release's own: the control credential's and the leader election's
    roles = sorted((r["metadata"]["namespace"], r["metadata"]["name"]) for r in by_kind(docs, "Role"))
    assert [ns for ns, _ in roles] == ["ml", "naiad-system", "naiad-system", "team-a"]
    assert ("naiad-system", "naiad-leader-election") in roles
    credential = next(
        r
        for r in by_kind(docs, "Role")
        if r["metadata"]["namespace"] == "naiad-system" and r["metadata"]["name"] != "naiad-leader-election"
    )
    assert credential["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "update", "patch"]}
    ]
    bindings = sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding"))
    assert bindings == ["ml", "naiad-system", "naiad-system", "team-a"]
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--namespace=team-a" in args
    failed = helm("template", "naiad", str(CHART), "--set", "rbac.scope=namespace")
    assert failed.returncode != 0


# What the operator does to the API (kube.py calls and kopf's own), to check the role grants it all.
NEEDED = [
    ("naiad.dev", "inferenceservers", {"get", "list", "watch", "patch", "create"}),
    ("naiad.dev", "inferencemodels", {"get", "list", "watch", "patch"}),
    ("naiad.dev", "inferenceservers/status", {"patch"}),
    ("naiad.dev", "inferencemodels/status", {"patch"}),
    ("apps", "deployments", {"get", "patch", "create"}),
    ("apps", "replicasets", {"list"}),
    ("", "services", {"patch", "create"}),
    ("", "persistentvolumeclaims", {"patch", "create"}),
    ("", "pods", {"list", "watch", "patch"}),
    ("", "pods/status", {"patch"}),
    ("autoscaling", "horizontalpodautoscalers", {"get", "patch", "create", "delete"}),
    ("monitoring.coreos.com", "servicemonitors", {"get", "patch", "create", "delete"}),
    ("inference.networking.k8s.io", "inferencepools", {"get", "patch", "create", "delete"}),
    ("", "events", {"create"}),
    ("", "secrets", {"get", "create", "patch"}),  # control credential and its per-pool copies; tls ca.crt
    ("networking.k8s.io", "networkpolicies", {"get", "patch", "create", "delete"}),
    ("discovery.k8s.io", "endpointslices", {"list"}),
    ("policy", "poddisruptionbudgets", {"get", "watch", "patch", "create", "delete"}),
    ("apps", "deployments", {"watch"}),
    ("", "services", {"watch"}),
]


def test_leader_election_role_and_single_replica_mode():
    docs = template()
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == "naiad-leader-election"]
    assert role["metadata"]["namespace"] == "naiad-system"
    assert grants(role["rules"], "coordination.k8s.io", "leases", {"create", "get", "update"})
    named = next(r for r in role["rules"] if "resourceNames" in r)
    assert named["resourceNames"] == ["naiad"]  # get/update only its own Lease
    (deployment,) = by_kind(docs, "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {
        "name": "NAIAD_LEADER_ELECT_NAMESPACE",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
    } in env
    single = template("replicaCount=1", "leaderElection.enabled=false")
    (deployment,) = by_kind(single, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-elect" not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [r for r in by_kind(single, "Role") if r["metadata"]["name"] == "naiad-leader-election"]
    # two operators without an election would fight: the chart refuses
    refused = helm("template", "naiad", str(CHART), "--set", "leaderElection.enabled=false")
    assert refused.returncode != 0 and "leaderElection" in refused.stderr


def grants(rules: list[dict], group: str, resource: str, verbs: set[str]) -> bool:
    allowed = set()
    for rule in rules:
        if group in rule["apiGroups"] and resource in rule["resources"]:
            allowed |= set(rule["verbs"])
    return verbs <= allowed


def test_rbac_grants_what_the_operator_uses():
    docs = template()
    role = next(d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"] == "naiad")
    for group, resource, verbs in NEEDED:
        assert grants(role["rules"], group, resource, verbs), (group, resource, verbs)
    # least privilege: no wildcards; Secrets only by name (never listed or watched)
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        if "secrets" in rule["resources"]:
            assert not {"list", "watch"} & set(rule["verbs"])


def test_network_policy_settings_reach_the_operator():
    docs = template(
        "networkPolicy.enabled=true",
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=observability",
    )
    container = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NAIAD_NETWORK_POLICY"] == "true"
    assert json.loads(env["NAIAD_NETWORK_POLICY_METRICS_FROM"]) == [
        {"namespaceSelector": {"matchLabels": {"team": "observability"}}}
    ]
