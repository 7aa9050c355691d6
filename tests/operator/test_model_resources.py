"""Renderers of an InferenceModel: what to load, which pool, the dedicated InferenceServer, Services and HPA."""

from __future__ import annotations

import json

import pytest

from naiad_operator.config import OperatorConfig
from naiad_operator.model_resources import (
    Repository,
    endpoint,
    load_config,
    model_autoscaling_ignored,
    model_intent,
    model_selector,
    parse_storage_uri,
    pool_problems,
    render_dedicated_server,
    render_model_hpa,
    render_model_services,
    revision_of,
)
from naiad_operator.naming import DEDICATED_FOR_LABEL, SERVER_LABEL, SERVICE_ROLE_LABEL
from naiad_operator.ownership import Owner

OWNER = Owner("naiad.dev/v1alpha1", "InferenceModel", "resnet", "uid-m", "ml")
CONFIG = OperatorConfig(queue_metric_name="queue_us")


def test_model_name_defaults_to_resource_name_then_path():
    assert model_intent("resnet", {}).model_name == "resnet"
    assert model_intent("resnet", {"modelName": "resnet50"}).model_name == "resnet50"
    assert (
        model_intent("resnet", {"path": "vision/resnet50", "serverRef": {"name": "p"}}).model_name
        == "resnet50"
    )


def test_shared_and_dedicated_pools():
    shared = model_intent("resnet", {"serverRef": {"name": "gpu"}, "replicas": 3, "maxReplicas": 2})
    assert shared.pool == "gpu" and not shared.dedicated
    assert shared.replicas == 2  # clamped to maxReplicas
    dedicated = model_intent("resnet", {"server": {"image": "x"}})
    assert dedicated.pool == "resnet-server" and dedicated.dedicated
    assert dedicated.replicas is None  # every pod of its own pool


def test_version_becomes_a_specific_version_policy_in_the_config_override():
    assert load_config({}) is None
    assert load_config({"version": 3}) == {"version_policy": {"specific": {"versions": [3]}}}
    config = {"max_batch_size": 8, "dynamic_batching": {}}
    merged = load_config({"config": config, "version": 2})
    assert merged == {**config, "version_policy": {"specific": {"versions": [2]}}}
    assert "version_policy" not in config  # the spec is not modified
    assert model_intent("m", {"version": 2}).version == "2"


def test_revision_changes_with_config_version_and_name_only():
    base = model_intent("m", {"config": {"max_batch_size": 8}})
    assert base.revision == model_intent("m", {"config": {"max_batch_size": 8}, "replicas": 5}).revision
    assert base.revision != model_intent("m", {"config": {"max_batch_size": 16}}).revision
    assert base.revision != model_intent("m", {"config": {"max_batch_size": 8}, "version": 2}).revision
    assert base.revision != model_intent("m", {"modelName": "x", "config": {"max_batch_size": 8}}).revision
    assert revision_of("m", {"a": 1, "b": 2}) == revision_of("m", {"b": 2, "a": 1})


def test_storage_uris():
    assert parse_storage_uri("pvc://models") == Repository("models", "")
    assert parse_storage_uri("pvc://models/team/a/") == Repository("models", "team/a")
    assert parse_storage_uri("file:///opt/repo/") == Repository(None, "", "/opt/repo")
    for bad in ("gs://bucket/x", "pvc:///x", "file://relative", "s3://", "https://h/model.txt"):
        with pytest.raises(ValueError):
            parse_storage_uri(bad)


def test_intent_problems():
    assert model_intent("resnet", {"serverRef": {"name": "p"}}).problems == []
    assert model_intent("Res.Net", {"serverRef": {"name": "p"}}).problems
    assert model_intent("resnet", {"serverRef": {"name": "p"}, "server": {}}).problems
    assert model_intent("resnet", {"serverRef": {"name": "p"}, "storage": {"uri": "gs://x"}}).problems
    assert model_intent("resnet", {"serverRef": {"name": "p"}, "memory": "much"}).problems
    mismatch = model_intent("resnet", {"serverRef": {"name": "p"}, "modelName": "a", "path": "dir/b"})
    assert any("directory name" in p for p in mismatch.problems)
    no_volume = model_intent("resnet", {"path": "dir/resnet"})
    assert any("needs a volume" in p for p in no_volume.problems)
    assert (
        model_intent(
            "resnet", {"path": "dir/resnet", "server": {"modelRepository": {"claimName": "c"}}}
        ).problems
        == []
    )


def test_dedicated_server_takes_template_repository_and_size_from_the_model():
    spec = {
        "server": {
            "image": "img",
            "replicas": 9,
            "maxReplicas": 9,
            "autoscaling": {"enabled": True},
            "resources": {"limits": {"nvidia.com/gpu": 1}},
        },
        "storage": {"uri": "pvc://models/prod"},
        "replicas": 2,
    }
    intent = model_intent("resnet", spec)
    server = render_dedicated_server(OWNER, spec, intent)
    assert server["kind"] == "InferenceServer" and server["metadata"]["name"] == "resnet-server"
    assert server["metadata"]["labels"][DEDICATED_FOR_LABEL] == "resnet"
    assert server["metadata"]["ownerReferences"][0]["uid"] == "uid-m"
    assert server["spec"]["image"] == "img"
    assert server["spec"]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert server["spec"]["replicas"] == 2
    assert "maxReplicas" not in server["spec"]
    assert server["spec"]["autoscaling"] == {"enabled": False}  # the model's HPA scales the model instead
    assert server["spec"]["modelRepository"] == {"claimName": "models", "subPath": "prod"}


def test_dedicated_server_for_path_and_file_repositories_and_suspension():
    spec = {
        "server": {"modelRepository": {"create": {"size": "5Gi"}}},
        "path": "team/resnet",
        "suspended": True,
    }
    server = render_dedicated_server(OWNER, spec, model_intent("resnet", spec))
    assert server["spec"]["modelRepository"] == {"create": {"size": "5Gi"}, "subPath": "team"}
    assert server["spec"]["replicas"] == 0
    spec = {"storage": {"uri": "file:///opt/models"}}
    server = render_dedicated_server(OWNER, spec, model_intent("resnet", spec))
    assert server["spec"]["modelRepository"] == {"path": "/opt/models"}


def test_model_services_select_pods_that_hold_the_model():
    intent = model_intent("resnet", {"serverRef": {"name": "gpu"}})
    service, headless = render_model_services(OWNER, intent)
    selector = {SERVER_LABEL: "gpu", "naiad.dev/model-resnet": "loaded"}
    assert model_selector(intent) == selector
    assert service["metadata"]["name"] == "resnet" and service["spec"]["selector"] == selector
    assert service["metadata"]["labels"][SERVICE_ROLE_LABEL] == "model"
    assert [p["port"] for p in service["spec"]["ports"]] == [8000, 8001]
    assert headless["metadata"]["name"] == "resnet-headless" and headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == selector
    assert service["metadata"]["ownerReferences"][0]["uid"] == "uid-m"


def test_model_hpa_scales_a_dedicated_model_on_its_own_queue_time():
    spec = {
        "minReplicas": 1,
        "maxReplicas": 4,
        "autoscaling": {"targetQueueTimeMicroseconds": 800},
        "modelName": "resnet50",
    }
    hpa = render_model_hpa(OWNER, spec, model_intent("resnet", spec), CONFIG)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "naiad.dev/v1alpha1",
        "kind": "InferenceModel",
        "name": "resnet",
    }
    assert hpa["spec"]["metrics"][0]["pods"]["metric"] == {
        "name": "queue_us",
        "selector": {"matchLabels": {"model": "resnet50"}},
    }
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "800"
    suspended = {**spec, "suspended": True}
    assert render_model_hpa(OWNER, suspended, model_intent("resnet", suspended), CONFIG) is None
    assert render_model_hpa(OWNER, {}, model_intent("resnet", {}), CONFIG) is None


def test_models_on_shared_pools_get_no_hpa():
    # Two HPAs over the same pods disable each other (AmbiguousSelector), and a shared pool's pods are shared.
    spec = {"serverRef": {"name": "gpu"}, "minReplicas": 1, "maxReplicas": 4}
    intent = model_intent("resnet", spec)
    assert render_model_hpa(OWNER, spec, intent, CONFIG) is None
    assert model_autoscaling_ignored(spec, intent)
    assert not model_autoscaling_ignored({"maxReplicas": 4}, model_intent("resnet", {"maxReplicas": 4}))


def test_pool_problems():
    pool = {
        "metadata": {"name": "gpu"},
        "spec": {
            "capabilities": {"backends": ["onnxruntime", "python"]},
            "modelRepository": {"claimName": "models", "subPath": "prod"},
        },
    }
    ok = model_intent(
        "m", {"serverRef": {"name": "gpu"}, "backend": "python", "storage": {"uri": "pvc://models/prod"}}
    )
    assert pool_problems(ok, pool) == []
    assert pool_problems(model_intent("m", {"serverRef": {"name": "gpu"}, "backend": "tensorrt"}), pool)
    assert pool_problems(
        model_intent("m", {"serverRef": {"name": "gpu"}, "storage": {"uri": "pvc://other"}}), pool
    )
    assert pool_problems(model_intent("m", {"serverRef": {"name": "gpu"}, "path": "dev/m"}), pool)
    assert pool_problems(model_intent("m", {"serverRef": {"name": "gpu"}, "path": "prod/m"}), pool) == []
    image_repo = model_intent("m", {"serverRef": {"name": "gpu"}, "storage": {"uri": "file:///models"}})
    assert pool_problems(image_repo, {"spec": {}}) == []
    assert pool_problems(image_repo, pool)
    # A dedicated pool must have been made for this model.
    dedicated = model_intent("m", {})
    assert pool_problems(dedicated, {"metadata": {"labels": {DEDICATED_FOR_LABEL: "m"}}, "spec": {}}) == []
    assert pool_problems(dedicated, {"metadata": {"labels": {}}, "spec": {}})
    bad_template = {"metadata": {"labels": {DEDICATED_FOR_LABEL: "m"}}, "spec": {"args": ["--http-port=1"]}}
    assert pool_problems(dedicated, bad_template)[0].startswith("server: args: --http-port")


def test_endpoint():
    intent = model_intent("resnet", {"serverRef": {"name": "gpu"}, "modelName": "resnet50"})
    assert endpoint(intent, "ml") == {
        "service": "resnet",
        "http": "http://resnet.ml.svc:8000/v2/models/resnet50",
        "grpc": "resnet.ml.svc:8001",
    }


def test_load_config_is_json_serialisable():
    json.dumps(load_config({"config": {"parameters": {"k": {"string_value": "v"}}}, "version": 1}))
