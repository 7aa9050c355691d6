"""Object-store repositories in the operator: s3:// and https:// storage URIs, their Secret, and how a pool that
reads one is rendered (arguments, environment, cache volume) without a credential in arguments or status."""

from __future__ import annotations

import json

import pytest

from naiad_operator.config import OperatorConfig
from naiad_operator.model_resources import (
    model_intent,
    parse_storage_uri,
    pool_problems,
    render_dedicated_server,
)
from naiad_operator.naming import DEDICATED_FOR_LABEL
from naiad_operator.ownership import Owner
from naiad_operator.pool_resources import render_deployment
from naiad_operator.server_spec import server_args, server_spec_problems

OWNER = Owner("naiad.dev/v1alpha1", "InferenceModel", "resnet", "uid-m", "ml")
CONFIG = OperatorConfig(server_image="registry.example/naiad:1", queue_metric_name="queue_us")
S3 = "s3://http://minio.storage.svc:9000/models/prod"


def test_storage_uris():
    repo = parse_storage_uri(S3 + "/", "s3-creds")
    assert (repo.uri, repo.secret, repo.claim, repo.path) == (S3, "s3-creds", None, None)
    assert parse_storage_uri("s3://bucket").uri == "s3://bucket"
    archive = parse_storage_uri("https://models.example/add_sub.tar.gz#sha256=" + "a" * 64)
    assert archive.uri.endswith("#sha256=" + "a" * 64) and archive.secret is None
    with pytest.raises(ValueError, match="names no bucket"):
        parse_storage_uri("s3://")
    with pytest.raises(ValueError, match="archive"):
        parse_storage_uri("https://models.example/add_sub/")
    with pytest.raises(ValueError, match="secretRef holds object-store credentials"):
        parse_storage_uri("pvc://claim/dir", "s3-creds")
    with pytest.raises(ValueError, match="'https://models.example/m.txt'"):
        parse_storage_uri("https://user:hunter2@models.example/m.txt")


def test_dedicated_pool_reads_the_bucket_with_the_secret_as_environment():
    spec = {"modelName": "resnet", "storage": {"uri": S3, "secretRef": {"name": "s3-creds"}}, "replicas": 2}
    intent = model_intent("resnet", spec)
    assert intent.problems == []
    server = render_dedicated_server(OWNER, spec, intent)
    assert server["spec"]["modelRepository"] == {"uri": S3, "secretRef": {"name": "s3-creds"}}
    pool_owner = Owner("naiad.dev/v1alpha1", "InferenceServer", intent.pool, "uid-s", "ml")
    deployment = render_deployment(pool_owner, server["spec"], CONFIG)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert f"--model-repository={S3}" in container["args"]
    assert "--storage-cache-dir=/var/cache/naiad" in container["args"]
    assert "--model-control-mode=explicit" in container["args"]
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert {"name": "model-cache", "mountPath": "/var/cache/naiad"} in container["volumeMounts"]
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    assert not any("persistentVolumeClaim" in v for v in pod["volumes"])
    assert "AWS_SECRET_ACCESS_KEY" not in json.dumps(container["args"])


def test_pod_identity_without_a_secret():
    spec = {"storage": {"uri": "s3://bucket/models"}}
    intent = model_intent("m", spec)
    server = render_dedicated_server(OWNER, spec, intent)
    assert server["spec"]["modelRepository"] == {"uri": "s3://bucket/models"}
    container = render_deployment(OWNER, {**server["spec"], "serviceAccountName": "irsa"}, CONFIG)["spec"][
        "template"
    ]["spec"]["containers"][0]
    assert "envFrom" not in container
    assert server_args(server["spec"])[1] == "--model-repository=s3://bucket/models"


def test_shared_pool_serves_models_from_its_own_bucket():
    pool = {
        "metadata": {"name": "cpu"},
        "spec": {"modelRepository": {"uri": S3, "secretRef": {"name": "s3-creds"}}},
    }
    ok = model_intent(
        "m", {"serverRef": {"name": "cpu"}, "storage": {"uri": S3, "secretRef": {"name": "s3-creds"}}}
    )
    assert pool_problems(ok, pool) == []
    assert (
        pool_problems(model_intent("m", {"serverRef": {"name": "cpu"}, "storage": {"uri": S3}}), pool) == []
    )
    other = model_intent("m", {"serverRef": {"name": "cpu"}, "storage": {"uri": "s3://other/models"}})
    assert pool_problems(other, pool) == [
        "InferenceServer cpu does not serve the repository s3://other/models (set its modelRepository.uri to "
        "it, or use a dedicated pool)"
    ]
    wrong_secret = model_intent(
        "m", {"serverRef": {"name": "cpu"}, "storage": {"uri": S3, "secretRef": {"name": "mine"}}}
    )
    assert "Secret 'mine'" in pool_problems(wrong_secret, pool)[0]
    claim_pool = {"metadata": {"name": "cpu"}, "spec": {"modelRepository": {"claimName": "models"}}}
    assert pool_problems(ok, claim_pool)
    userinfo = model_intent(
        "m", {"serverRef": {"name": "cpu"}, "storage": {"uri": "https://u:hunter2@h.example/m.tar.gz"}}
    )
    assert "hunter2" not in json.dumps(pool_problems(userinfo, pool))


def test_pool_spec_problems_for_object_store_repositories():
    assert server_spec_problems("p", {"modelRepository": {"uri": S3, "claimName": "c"}}) == [
        "modelRepository: set either uri or a claim (claimName, create), not both"
    ]
    assert server_spec_problems("p", {"modelRepository": {"secretRef": {"name": "s"}}}) == [
        "modelRepository: secretRef holds object-store credentials; it needs uri"
    ]
    dedicated = model_intent("m", {"storage": {"uri": S3}})
    made = {"metadata": {"labels": {DEDICATED_FOR_LABEL: "m"}}, "spec": {"modelRepository": {"uri": S3}}}
    assert pool_problems(dedicated, made) == []
