"""The CRDs: generated files are current, schemas are structural, defaults and printer columns are sound, and
what the operator writes (dedicated InferenceServers, statuses) survives the schema without being pruned."""

from __future__ import annotations

import copy
import functools
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")  # in the test extra
from naiad_operator.config import OperatorConfig
from naiad_operator.model_resources import model_intent, render_dedicated_server
from naiad_operator.ownership import Owner
from naiad_operator.status import ModelCount, ModelObservation, Placement, model_status, server_status

ROOT = Path(__file__).resolve().parents[2]
CRD_FILES = sorted((ROOT / "crds").glob("*.yaml"))


def load_generator():
    spec = importlib.util.spec_from_file_location("crd_generate", ROOT / "crds" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def _crds() -> dict[str, dict]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    docs = [yaml.load(p.read_text(), Loader=loader) for p in CRD_FILES]
    return {doc["spec"]["names"]["kind"]: doc for doc in docs}


def crds() -> dict[str, dict]:
    return copy.deepcopy(_crds())


def schema_of(kind: str) -> dict:
    return crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crds_match_the_generator_in_both_places():
    rendered = load_generator().render()
    assert sorted(rendered) == [p.name for p in CRD_FILES]
    for name, text in rendered.items():
        assert (ROOT / "crds" / name).read_text() == text, (
            f"crds/{name} is stale: run python crds/generate.py"
        )
        assert (ROOT / "helm" / "naiad" / "crds" / name).read_text() == text, f"helm copy of {name} is stale"


def test_names_scope_and_subresources():
    found = crds()
    assert set(found) == {"InferenceServer", "InferenceModel"}
    for crd in found.values():
        spec = crd["spec"]
        assert crd["metadata"]["name"] == f"{spec['names']['plural']}.naiad.dev"
        assert spec["group"] == "naiad.dev" and spec["scope"] == "Namespaced"
        (version,) = spec["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"]["status"] == {}
        assert version["subresources"]["scale"] == {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    assert found["InferenceModel"]["spec"]["names"]["shortNames"] == ["im"]


JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
FORBIDDEN_IN_JUNCTORS = ("description", "type", "default", "additionalProperties", "nullable")


def structural_violations(node: dict, path: str, in_junctor: bool = False) -> list[str]:
    """The rules of a structural schema that can be checked without an API server."""
    problems = []
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if not in_junctor and "type" not in node and not int_or_string and not preserve:
        problems.append(f"{path}: no type")
    if in_junctor:
        problems += [f"{path}: {key} inside a junctor" for key in FORBIDDEN_IN_JUNCTORS if key in node]
    for junctor in JUNCTORS:
        branches = node.get(junctor)
        if branches is None:
            continue
        if int_or_string and junctor == "anyOf" and branches == [{"type": "integer"}, {"type": "string"}]:
            continue  # the one allowed pattern
        for i, branch in enumerate(branches if isinstance(branches, list) else [branches]):
            for key in branch.get("properties", {}):
                if key not in node.get("properties", {}):
                    problems.append(f"{path}.{junctor}[{i}].{key}: not declared outside the junctor")
            problems += structural_violations(branch, f"{path}.{junctor}[{i}]", True)
    if node.get("type") == "object" and "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: both properties and additionalProperties")
    for key, child in (node.get("properties") or {}).items():
        problems += structural_violations(child, f"{path}.{key}", in_junctor)
    if isinstance(node.get("additionalProperties"), dict):
        problems += structural_violations(node["additionalProperties"], f"{path}.*", in_junctor)
    if isinstance(node.get("items"), dict):
        problems += structural_violations(node["items"], f"{path}[]", in_junctor)
    if node.get("x-kubernetes-list-type") == "map":
        keys = node.get("x-kubernetes-list-map-keys") or []
        required = (node.get("items") or {}).get("required") or []
        problems += [f"{path}: list-map key {k} not required" for k in keys if k not in required]
    return problems


@pytest.mark.parametrize("kind", ["InferenceServer", "InferenceModel"])
def test_schemas_are_structural(kind):
    schema = schema_of(kind)
    assert schema["type"] == "object"
    assert schema["properties"]["metadata"] == {"type": "object"}  # no restrictions beyond name/generateName
    assert structural_violations(schema, kind) == []


def walk(node: dict, path: str = ""):
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}.*")


@pytest.mark.parametrize("kind", ["InferenceServer", "InferenceModel"])
def test_defaults_and_enums_are_valid_against_their_own_schema(kind):
    checked = 0
    for _path, node in walk(schema_of(kind)):
        if "default" in node:
            jsonschema.validate(node["default"], node)
            checked += 1
        if "enum" in node:
            for value in node["enum"]:
                jsonschema.validate(value, {k: v for k, v in node.items() if k != "enum"})
    assert checked >= 5


def resolve(schema: dict, json_path: str) -> dict:
    """Follow a printer-column or scale JSONPath (.a.b, .a[?(@.k=="v")].b) through the schema."""
    node = schema
    for part in re.findall(r"\.([A-Za-z0-9_]+)(\[\?\(@\.[a-z]+==\"[A-Za-z]+\"\)\])?", json_path):
        name, filtered = part
        if name not in node.get("properties", {}):
            raise KeyError(f"{json_path}: no {name}")
        node = node["properties"][name]
        if filtered:
            assert node["type"] == "array"
            node = node["items"]
    return node


COLUMN_TYPES = {
    "integer": {"integer"},
    "string": {"string"},
    "date": {"string"},
    "number": {"integer", "number"},
    "boolean": {"boolean"},
}


@pytest.mark.parametrize("kind", ["InferenceServer", "InferenceModel"])
def test_printer_columns_and_scale_paths_reference_existing_fields(kind):
    crd = crds()[kind]
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    schema = copy.deepcopy(schema)
    schema["properties"]["metadata"] = {
        "type": "object",
        "properties": {"creationTimestamp": {"type": "string"}},
    }
    for column in version["additionalPrinterColumns"]:
        node = resolve(schema, column["jsonPath"])
        assert node["type"] in COLUMN_TYPES[column["type"]], column
    for path in version["subresources"]["scale"].values():
        resolve(schema, path)
    assert resolve(schema, ".spec.replicas")["type"] == "integer"
    assert resolve(schema, ".status.selector")["type"] == "string"


def closed(schema: dict) -> dict:
    """The schema with every plain object closed (additionalProperties: false), to catch what the API server
    would prune."""
    schema = copy.deepcopy(schema)
    for _, node in walk(schema):
        if (
            node.get("type") == "object"
            and "properties" in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
    return schema


def validate_closed(instance, schema):
    jsonschema.validate(instance, closed(schema))


EXAMPLE_SERVER = {
    "apiVersion": "naiad.dev/v1alpha1",
    "kind": "InferenceServer",
    "metadata": {"name": "gpu-pool"},
    "spec": {
        "image": "ghcr.io/naiad-dev/naiad-server:0.1.0-cuda",
        "replicas": 2,
        "minReplicas": 1,
        "maxReplicas": 8,
        "autoscaling": {
            "targetQueueTimeMicroseconds": 10000,
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
        "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "24Gi"}, "requests": {"cpu": "500m"}},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A10G"},
        "modelRepository": {"claimName": "model-store", "subPath": "prod"},
        "capabilities": {"backends": ["onnxruntime", "python"]},
        "capacity": {"maxModels": 8, "memory": "20Gi"},
        "probes": {"startup": {"failureThreshold": 120}},
        "env": [{"name": "OMP_NUM_THREADS", "value": "4"}],
    },
}
EXAMPLE_MODEL = {
    "apiVersion": "naiad.dev/v1alpha1",
    "kind": "InferenceModel",
    "metadata": {"name": "resnet"},
    "spec": {
        "serverRef": {"name": "gpu-pool"},
        "modelName": "resnet50",
        "version": 1,
        "replicas": 2,
        "config": {"max_batch_size": 16, "dynamic_batching": {"max_queue_delay_microseconds": 500}},
        "memory": "2Gi",
        "backend": "onnxruntime",
    },
}


def test_example_resources_validate():
    validate_closed(EXAMPLE_SERVER, schema_of("InferenceServer"))
    validate_closed(EXAMPLE_MODEL, schema_of("InferenceModel"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {**EXAMPLE_MODEL, "spec": {**EXAMPLE_MODEL["spec"], "replicas": -1}}, schema_of("InferenceModel")
        )
    with pytest.raises(jsonschema.ValidationError):
        bad = copy.deepcopy(EXAMPLE_SERVER)
        bad["spec"]["imagePullPolicy"] = "Sometimes"
        jsonschema.validate(bad, schema_of("InferenceServer"))
    with pytest.raises(jsonschema.ValidationError):
        bad = copy.deepcopy(EXAMPLE_SERVER)
        bad["spec"]["capacity"]["memory"] = "lots"
        jsonschema.validate(bad, schema_of("InferenceServer"))


def test_the_model_server_template_is_the_server_spec_schema():
    """The same schema, but for what only a shared pool has: going down to zero pods (test_pool_wake.py)."""
    model_spec = schema_of("InferenceModel")["properties"]["spec"]["properties"]["server"]
    server_spec = schema_of("InferenceServer")["properties"]["spec"]
    pool_only = {"minReplicas", "scaleToZero"}
    assert set(server_spec["properties"]) - set(model_spec["properties"]) == {"scaleToZero"}
    assert {k: v for k, v in model_spec["properties"].items() if k not in pool_only} == {
        k: v for k, v in server_spec["properties"].items() if k not in pool_only
    }


def test_rendered_dedicated_servers_fit_the_schema_without_pruning():
    owner = Owner("naiad.dev/v1alpha1", "InferenceModel", "resnet", "uid", "ml")
    spec = {"server": EXAMPLE_SERVER["spec"], "storage": {"uri": "pvc://models/prod"}, "replicas": 3}
    server = render_dedicated_server(owner, spec, model_intent("resnet", spec))
    validate_closed({**server, "metadata": {"name": "x"}}, schema_of("InferenceServer"))


def test_written_statuses_fit_the_schema_without_pruning():
    now = "2024-01-01T00:00:00Z"
    observed = ModelObservation(
        wanted=2,
        holding=2,
        available=1,
        shortfall=1,
        eligible_pods=2,
        placements=[
            Placement("p", "Loaded", "10.0.0.1", "1", "older revision"),
            Placement("q", "Failed", None, None, "oom"),
        ],
        failure={"time": now, "pod": "q", "message": "oom"},
    )
    status = model_status(
        generation=1,
        pool="gpu",
        model_name="m",
        revision="abc",
        selector="a=b",
        endpoint={"service": "m", "http": "h", "grpc": "g"},
        problems=[],
        suspended=False,
        pool_found=True,
        observed=observed,
        old_status=None,
        now=now,
    )
    validate_closed(status, schema_of("InferenceModel")["properties"]["status"])
    status = server_status(
        generation=1,
        selector="a=b",
        desired=1,
        deployment={"status": {"replicas": 1}},
        hpa=None,
        hpa_wanted=False,
        models=[ModelCount("m", "m", 1)],
        problems=[],
        old_conditions=None,
        now=now,
    )
    validate_closed(status, schema_of("InferenceServer")["properties"]["status"])


def test_operator_config_defaults_match_the_crd_defaults():
    autoscaling = schema_of("InferenceServer")["properties"]["spec"]["properties"]["autoscaling"]
    assert autoscaling["properties"]["targetQueueTimeMicroseconds"]["default"] == 20000
    assert OperatorConfig().queue_metric_name == "naiad_queue_time_per_request_us"
