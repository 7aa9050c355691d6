"""A request's model version string: read as Triton's std::stol reads it, refused with Triton's texts on every path."""

from __future__ import annotations

import grpc
import pytest
import requests
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from naiad.errors import InvalidArgument
from naiad.version_string import parse_version

BAD = "failed to get model version from specified version string '{}' (details: stol), version should be an integral value > 0"
NEGATIVE = "invalid model version specified '{}' , version should be an integral value > 0"


@pytest.mark.parametrize(
    "text, version",
    [("", -1), ("1", 1), ("0", 0), ("+3", 3), (" 2", 2), ("\t7", 7), ("2abc", 2), ("-0", 0), ("007", 7)],
)
def test_parse_version_reads_as_stol(text, version):
    assert parse_version(text) == version


@pytest.mark.parametrize(
    "text, template",
    [
        ("wrong_specification", BAD),
        ("abc", BAD),
        (" ", BAD),
        ("+", BAD),
        ("a1", BAD),
        ("9223372036854775808", BAD),  # one past int64: std::out_of_range, whose what() is "stol" too
        ("-1", NEGATIVE),
        ("-5x", NEGATIVE),
    ],
)
def test_parse_version_errors_are_tritons(text, template):
    with pytest.raises(InvalidArgument) as info:
        parse_version(text)
    assert info.value.message == template.format(text)


def _infer_request(version: str) -> pb.ModelInferRequest:
    """The request of Triton's grpc_explicit_int8_content_client.py example, on this repository's model."""
    req = pb.ModelInferRequest(model_name="identity_fp32", model_version=version)
    inp = req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 3])
    inp.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    req.outputs.add(name="OUTPUT0")
    return req


RPCS = {
    "ModelInfer": _infer_request,
    "ModelMetadata": lambda v: pb.ModelMetadataRequest(name="identity_fp32", version=v),
    "ModelConfig": lambda v: pb.ModelConfigRequest(name="identity_fp32", version=v),
    "ModelReady": lambda v: pb.ModelReadyRequest(name="identity_fp32", version=v),
    "ModelStatistics": lambda v: pb.ModelStatisticsRequest(name="identity_fp32", version=v),
}


@pytest.fixture(scope="module")
def stub(naiad):
    with grpc.insecure_channel(naiad.grpc) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.mark.parametrize("rpc", sorted(RPCS))
@pytest.mark.parametrize("version, template", [("wrong_specification", BAD), ("-1", NEGATIVE)])
def test_grpc_per_model_rpcs_refuse_a_bad_version(stub, rpc, version, template):
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, rpc)(RPCS[rpc](version), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == template.format(version)


def test_grpc_stream_infer_reports_a_bad_version(stub):
    (resp,) = list(stub.ModelStreamInfer(iter([_infer_request("wrong_specification")]), timeout=30))
    assert resp.error_message == BAD.format("wrong_specification")


def test_grpc_good_version_strings_still_infer(stub):
    for version in ("", "1", "+1"):
        resp = stub.ModelInfer(_infer_request(version), timeout=30)
        assert resp.model_version == "1"


@pytest.mark.parametrize("suffix", ["", "/ready", "/config", "/stats", "/infer"])
def test_http_version_segments(naiad, suffix):
    """Triton's HTTP routes match digits only (404 otherwise); digits past int64 are its parse error (400)."""
    base = f"{naiad.url}/v2/models/identity_fp32/versions"
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}

    def call(version: str) -> requests.Response:
        url = f"{base}/{version}{suffix}"
        if suffix == "/infer":
            return requests.post(url, json=body, timeout=30)
        return requests.get(url, timeout=30)

    assert call("wrong_specification").status_code == 404
    huge = "99999999999999999999"
    r = call(huge)
    assert r.status_code == 400 and r.json() == {"error": BAD.format(huge)}
    assert call("1").status_code == 200
