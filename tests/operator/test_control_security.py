"""The guarded control API and TLS from the operator's side: what pods are rendered with (no secret in args), the
installation's credential and its rotation, and the model-control client against a real Naiad server that
restricts its control APIs and serves HTTPS."""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
from pathlib import Path

import aiohttp
import pytest
from operator_fakes import NS, FakeKube

from naiad_operator.config import OperatorConfig
from naiad_operator.control import ModelControlClient, ModelControlError, ServerUnreachable
from naiad_operator.metrics_resources import render_service_monitor
from naiad_operator.ownership import Owner
from naiad_operator.pool_resources import render_deployment, render_pool
from naiad_operator.security import (
    CONTROL_ENV,
    CONTROL_HEADER,
    CREDENTIAL_HASH_ANNOTATION,
    INSTALLATION_SECRET,
    ROTATE_ANNOTATION,
    CredentialStore,
    TrustCache,
)
from naiad_operator.server_spec import server_spec_problems

on_session_loop = pytest.mark.asyncio(loop_scope="session")
OWNER = Owner("naiad.dev/v1alpha1", "InferenceServer", "pool", "uid-pool", NS)
CONFIG = OperatorConfig(server_image="img:1", operator_namespace="naiad-system")
CREDENTIAL = "Zm9vYmFyLXRoZS1jcmVkZW50aWFsLW9mLXRoaXMtdGVzdA"
ROOT = Path(__file__).resolve().parents[2]


def container(deployment):
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_pods_get_the_credential_through_env_never_in_args():
    objects = render_pool(OWNER, {"env": [{"name": "A", "value": "1"}]}, CONFIG, False, CREDENTIAL)
    secret, deployment = objects.apply[0], objects.apply[1]
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "pool-control"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-pool"
    assert base64.b64decode(secret["data"]["credential"]).decode() == CREDENTIAL
    # the credential is nowhere in the Deployment: not in args, env values or annotations
    assert CREDENTIAL not in json.dumps(deployment)
    c = container(deployment)
    rule = f"model-repository,shared-memory,logging,trace:{CONTROL_HEADER}=env:{CONTROL_ENV}"
    assert f"--http-restricted-api={rule}" in c["args"]
    assert f"--grpc-restricted-protocol={rule}" in c["args"]
    assert c["env"] == [
        {"name": "A", "value": "1"},
        {"name": CONTROL_ENV, "valueFrom": {"secretKeyRef": {"name": "pool-control", "key": "credential"}}},
    ]
    # a rotation changes the template (pods roll onto the new credential); the annotation is a hash of it
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    rotated = render_deployment(OWNER, {}, CONFIG, CREDENTIAL + "x")
    assert (
        rotated["spec"]["template"]["metadata"]["annotations"][CREDENTIAL_HASH_ANNOTATION]
        != (annotations[CREDENTIAL_HASH_ANNOTATION])
    )
    # inference and health are not restricted
    assert not any("inference" in a or "health" in a for a in c["args"] if "restricted" in a)


def test_no_credential_renders_the_old_open_pod():
    c = container(render_deployment(OWNER, {}, CONFIG))
    assert not any("restricted" in a for a in c["args"]) and "env" not in c


def test_tls_secret_is_mounted_and_turned_on_for_every_port():
    spec = {"tls": {"secretName": "pool-cert"}, "monitoring": {"interval": "30s"}}
    deployment = render_deployment(OWNER, spec, CONFIG, CREDENTIAL)
    c = container(deployment)
    for endpoint in ("http", "grpc", "metrics"):
        assert f"--{endpoint}-use-ssl=true" in c["args"]
        assert f"--{endpoint}-server-cert=/etc/naiad/tls/tls.crt" in c["args"]
        assert f"--{endpoint}-server-key=/etc/naiad/tls/tls.key" in c["args"]
    assert {"name": "tls", "mountPath": "/etc/naiad/tls", "readOnly": True} in c["volumeMounts"]
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "pool-cert", "defaultMode": 0o440}} in volumes
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS"
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    endpoint = render_service_monitor(OWNER, spec)["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "pool-cert", "key": "ca.crt"}},
        "serverName": f"pool.{NS}.svc",
    }
    # with spec.tls the operator owns the TLS flags
    problems = server_spec_problems("pool", {**spec, "args": ["--grpc-use-ssl=false"]})
    assert problems == ["args: --grpc-use-ssl is set by the operator and cannot be overridden"]
    assert server_spec_problems("pool", {"args": ["--grpc-use-ssl=true"]}) == []


def test_user_args_may_restrict_inference_but_not_the_control_groups():
    assert server_spec_problems("pool", {"args": ["--http-restricted-api=inference:k=env:K"]}) == []
    assert server_spec_problems("pool", {"args": ["--grpc-restricted-protocol=trace,inference:k=v"]}) == [
        "args: --grpc-restricted-protocol may not restrict trace: the operator restricts the control APIs to "
        "its own credential"
    ]


def test_network_policy_admits_only_the_operator_and_prometheus_to_metrics():
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    config = OperatorConfig(
        operator_namespace="naiad-system", network_policy=True, metrics_from=(prometheus,)
    )
    objects = render_pool(OWNER, {}, config, False, CREDENTIAL)
    policy = next(o for o in objects.apply if o["kind"] == "NetworkPolicy")
    assert ("networking.k8s.io/v1", "NetworkPolicy", "pool") not in objects.absent
    assert policy["spec"]["podSelector"] == {"matchLabels": {"naiad.dev/server": "pool"}}
    serving, metrics = policy["spec"]["ingress"]
    assert "from" not in serving and {p["port"] for p in serving["ports"]} == {"http", "grpc"}
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "naiad-system"}}},
        prometheus,
    ]


def test_every_kind_the_operator_writes_has_an_api_path():
    from naiad_operator.kube import resource_path

    config = OperatorConfig(network_policy=True)
    spec = {"tls": {"secretName": "c"}, "maxReplicas": 3, "modelRepository": {"create": {"size": "1Gi"}}}
    for body in render_pool(OWNER, spec, config, True, CREDENTIAL).apply:
        assert resource_path(body["apiVersion"], body["kind"], NS, body["metadata"]["name"])
    assert resource_path("v1", "Secret", "naiad-system", INSTALLATION_SECRET).startswith(
        "/api/v1/namespaces/"
    )


def test_operator_settings_for_the_network_policy():
    config = OperatorConfig.from_env(
        {
            "NAIAD_OPERATOR_NAMESPACE": "ops",
            "NAIAD_NETWORK_POLICY": "true",
            "NAIAD_NETWORK_POLICY_METRICS_FROM": '[{"podSelector": {}}]',
        }
    )
    assert (config.operator_namespace, config.network_policy, config.metrics_from) == (
        "ops",
        True,
        ({"podSelector": {}},),
    )
    with pytest.raises(ValueError, match="JSON list"):
        OperatorConfig.from_env({"NAIAD_NETWORK_POLICY_METRICS_FROM": "{not json"})


@on_session_loop
async def test_installation_credential_is_created_once_and_rotated_on_demand():
    kube = FakeKube()
    store = CredentialStore(kube, "naiad-system")
    first = await store.refresh()
    assert len(first.current) >= 40 and first.previous is None
    secret = kube.objects[("v1", "Secret", "naiad-system", INSTALLATION_SECRET)]
    assert base64.b64decode(secret["data"]["credential"]).decode() == first.current
    assert (await store.refresh()) == first  # stable across passes and operator restarts
    assert (await CredentialStore(kube, "naiad-system").refresh()) == first
    secret["metadata"]["annotations"] = {ROTATE_ANNOTATION: "please"}
    second = await store.refresh()
    assert second.current != first.current and second.previous == first.current
    assert store.to_try() == [second.current, first.current]
    assert ROTATE_ANNOTATION not in secret["metadata"]["annotations"]
    assert (await store.refresh()) == second


# --- against a real server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory):
    from helpers import NaiadProcess
    from pki import Pki

    work = tmp_path_factory.mktemp("secured")
    repo = work / "models"
    shutil.copytree(ROOT / "tests" / "models" / "add_sub", repo / "add_sub")
    pki = Pki(work / "pki", "pool-ca")
    cert, key = pki.issue("pool", dns=(f"pool.{NS}.svc",))
    args = [
        "--model-control-mode=explicit",
        f"--http-restricted-api=model-repository,shared-memory,logging,trace:{CONTROL_HEADER}=env:{CONTROL_ENV}",
        "--http-use-ssl=true",
        f"--http-server-cert={cert}",
        f"--http-server-key={key}",
    ]
    os.environ[CONTROL_ENV] = CREDENTIAL
    try:
        proc = NaiadProcess(repo, *args).start()
    finally:
        del os.environ[CONTROL_ENV]
    yield proc, pki
    proc.stop()


@on_session_loop
async def test_client_sends_the_credential_and_verifies_the_pool_certificate(secured_server, tmp_path):
    from pki import Pki

    proc, pki = secured_server
    host = "127.0.0.1"
    trust = TrustCache(FakeKube())
    async with aiohttp.ClientSession() as session:

        def client(credentials, ca=pki.ca, hostname=f"pool.{NS}.svc"):
            plain = ModelControlClient(
                session, port=proc.http_port, credentials=lambda: credentials, request_timeout=5
            )
            return plain.with_tls(ssl.create_default_context(cafile=ca), hostname)

        # the current credential, or the previous one after a rotation (a pod not yet rolled)
        await client([CREDENTIAL]).load(host, "add_sub")
        assert [e.state for e in await client(["rotated-new", CREDENTIAL]).index(host)] == ["READY"]
        # without it the server refuses: 403, the server's own message
        with pytest.raises(ModelControlError) as refused:
            await client(["wrong"]).unload(host, "add_sub")
        assert refused.value.status == 403 and CONTROL_HEADER in str(refused.value)
        with pytest.raises(ServerUnreachable, match="403"):
            await client([]).index(host)
        # health stays open
        assert await client([]).ready(host)
        # a certificate from another CA, or for another name, is not trusted
        stranger_ca = Pki(tmp_path / "other", "other-ca").ca
        with pytest.raises(ServerUnreachable, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await client([CREDENTIAL], ca=stranger_ca).index(host)
        with pytest.raises(ServerUnreachable, match="CERTIFICATE_VERIFY_FAILED|hostname|match"):
            await client([CREDENTIAL], hostname=f"other.{NS}.svc").index(host)
        # plain HTTP to the pool gets no answer
        plain = ModelControlClient(session, port=proc.http_port, credentials=lambda: [CREDENTIAL])
        with pytest.raises(ServerUnreachable):
            await plain.index(host)
        await client([CREDENTIAL]).unload(host, "add_sub")
    # the trust cache falls back to the system CAs when the Secret is absent (never to no verification)
    context = await trust.context(NS, "missing")
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
