"""InferenceModels from S3 on a real Kubernetes control plane: a pool whose repository is a bucket in a real
MinIO, credentials from a Secret (envFrom, never in pod args or status), models loaded live and answering through
their Service, fetch failures shown in status with the server's message.

Same harness as test_operator_cluster.py (its own cluster). Run: pytest tests/operator/test_operator_s3_cluster.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_operator_cluster import NS, ROOT, harness, model, pool, report, wait  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def minio(harness):  # noqa: F811
    """MinIO started after the cluster: the harness may move this process into its own network namespace, where
    only servers started afterwards are reachable on 127.0.0.1."""
    from minio_server import MinioServer

    server = MinioServer().start()
    yield server
    server.stop()


@pytest.fixture
def bucket(minio, request):
    client = minio.client()
    name = "e2e-" + request.node.name.replace("_", "-")[5:40].strip("-")
    client.create_bucket(Bucket=name)
    return name, client


def upload_add_sub(minio, client, bucket: str, prefix: str, name: str = "add_sub") -> None:
    src = ROOT / "tests" / "models" / "add_sub"
    for path in sorted(src.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            body = path.read_bytes()
            if path.name == "config.pbtxt":
                body = body.replace(b'name: "add_sub"', f'name: "{name}"'.encode())
            client.put_object(
                Bucket=bucket, Key=f"{prefix}/{name}/{path.relative_to(src).as_posix()}", Body=body
            )


def holders(h, pool_name: str, model_name: str) -> list[dict]:
    selector = f"naiad.dev/server={pool_name},naiad.dev/model-{model_name}=loaded"
    return h.get("pods", selector=selector)["items"]


def test_model_from_s3_loads_live_on_a_pool_and_answers_through_its_service(report, minio, bucket, tmp_path):  # noqa: F811
    h = report
    name, client = bucket
    upload_add_sub(minio, client, name, "repo")
    uri = f"s3://{minio.host}/{name}/repo"
    h.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s3-creds"},
            "stringData": minio.env(),
        }
    )
    h.apply(pool("s3pool", replicas=1, modelRepository={"uri": uri, "secretRef": {"name": "s3-creds"}}))
    h.apply(
        model(
            "s3-add-sub",
            serverRef={"name": "s3pool"},
            modelName="add_sub",
            storage={"uri": uri, "secretRef": {"name": "s3-creds"}},
            replicas=1,
        )
    )
    status = wait(
        lambda: (s := h.model_status("s3-add-sub")).get("phase") == "Available" and s,
        180,
        what="model Available",
    )
    assert status["server"] == "s3pool"
    (pod,) = holders(h, "s3pool", "s3-add-sub")
    ip = pod["status"]["podIP"]
    assert wait(lambda: h.endpoints("s3-add-sub") == {ip}, 60, what="model Service endpoints")
    (endpoint,) = h.endpoints("s3-add-sub")
    assert h.infer(endpoint) == [2.0, 3.0, 4.0, 5.0]
    # the credentials reach the server through the Secret only
    container = pod["spec"]["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert minio.secret_key not in json.dumps(pod["spec"]) + json.dumps(h.get("inferenceserver", "s3pool"))

    # a second model uploaded to the bucket later loads live on the same pod: no restart
    upload_add_sub(minio, client, name, "repo", name="add_sub_two")
    h.apply(
        model(
            "s3-two",
            serverRef={"name": "s3pool"},
            modelName="add_sub_two",
            storage={"uri": uri, "secretRef": {"name": "s3-creds"}},
            replicas=1,
        )
    )
    wait(lambda: h.model_status("s3-two").get("phase") == "Available", 180, what="second model Available")
    (same,) = h.get("pods", selector="naiad.dev/server=s3pool")["items"]
    assert same["metadata"]["uid"] == pod["metadata"]["uid"]
    assert all(c.get("restartCount", 0) == 0 for c in same["status"].get("containerStatuses") or [])

    # a model that is not in the bucket: the server's message in status, the secret nowhere
    h.apply(model("s3-missing", serverRef={"name": "s3pool"}, modelName="not_uploaded", storage={"uri": uri}))
    failed = wait(
        lambda: (s := h.model_status("s3-missing")).get("lastFailure") and s,
        180,
        what="a failed load in status",
    )
    assert "failed to poll from model repository" in failed["lastFailure"]["message"]
    assert minio.secret_key not in json.dumps(failed)
    assert h.infer(endpoint) == [2.0, 3.0, 4.0, 5.0]  # the other models are untouched
    h.kubectl("-n", NS, "delete", "im", "s3-add-sub", "s3-two", "s3-missing", "--timeout=90s")
    h.kubectl("-n", NS, "delete", "inferenceserver", "s3pool", "--timeout=90s")
    shutil.rmtree(Path(tmp_path), ignore_errors=True)


def test_dedicated_pool_from_one_s3_model(report, minio, bucket):  # noqa: F811
    h = report
    name, client = bucket
    upload_add_sub(minio, client, name, "models")
    h.apply(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "solo-creds"}, "stringData": minio.env()}
    )
    uri = f"s3://{minio.host}/{name}/models"
    h.apply(
        model(
            "s3-solo",
            modelName="add_sub",
            replicas=1,
            storage={"uri": uri, "secretRef": {"name": "solo-creds"}},
            server={
                "resources": {"limits": {"nvidia.com/gpu": 1}},
                "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}],
            },
        )
    )
    server = wait(lambda: h.get("inferenceserver", "s3-solo-server"), 60, what="dedicated InferenceServer")
    repository = server["spec"]["modelRepository"]  # plus the schema's default `path`, unused with a uri
    assert (repository["uri"], repository["secretRef"]) == (uri, {"name": "solo-creds"})
    wait(
        lambda: h.model_status("s3-solo").get("phase") == "Available",
        180,
        what="dedicated S3 model Available",
    )
    ip = next(iter(wait(lambda: h.endpoints("s3-solo"), 60, what="model Service endpoints")))
    assert h.infer(ip) == [2.0, 3.0, 4.0, 5.0]
    h.kubectl("-n", NS, "delete", "im", "s3-solo", "--timeout=90s")
