"""Shared fixtures: the test model repository and one live Naiad server for the session."""

from __future__ import annotations

from pathlib import Path

import pytest

# `naiad` comes from the editable install (make venv); build_models and helpers from this folder, which pytest
# puts on sys.path for the tests in it (rootdir-relative "prepend" imports: tests/ has no __init__.py).
from build_models import build
from helpers import NaiadProcess


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("repo") / "models")


@pytest.fixture(scope="session")
def naiad(model_repo):
    """A server on the full test repository; `broken_init` fails to load, so strict readiness is off."""
    proc = NaiadProcess(model_repo, "--strict-readiness", "false")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def http_client(naiad):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(naiad.http, concurrency=4)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_client(naiad):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(naiad.grpc)
    yield client
    client.close()


@pytest.fixture(scope="session")
def minio():
    """A real MinIO on 127.0.0.1 (tools/go/minio), with its own root credentials."""
    from minio_server import MinioServer

    server = MinioServer().start()
    yield server
    server.stop()


@pytest.fixture
def bucket(minio, request):
    """A fresh bucket for one test: (name, boto3 client)."""
    import re

    client = minio.client()
    name = (
        ("t-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower()))[:50].strip("-")
        + "-"
        + str(id(request))[-6:]
    )
    client.create_bucket(Bucket=name)
    return name, client
