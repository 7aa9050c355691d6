"""Readings of pods and indexes, and the metadata patches that keep pod labels truthful."""

from __future__ import annotations

import json

from naiad_operator.control import IndexEntry
from naiad_operator.model_resources import model_intent
from naiad_operator.naming import MODELS_READY_CONDITION, PLACEMENTS_ANNOTATION, RESTARTS_ANNOTATION
from naiad_operator.observe import (
    Held,
    PodTruth,
    current_template_hash,
    gate_patch,
    held_models,
    metadata_patch,
    pod_facts,
    pod_state,
    version_of,
)


def pod_body(
    name="p1",
    ip="10.0.0.5",
    ready=True,
    restarts=0,
    recorded=None,
    recorded_restarts=None,
    labels=None,
    deleting=False,
    template_hash="h2",
    gate=None,
):
    annotations = {}
    if recorded is not None:
        annotations[PLACEMENTS_ANNOTATION] = json.dumps(recorded)
    if recorded_restarts is not None:
        annotations[RESTARTS_ANNOTATION] = str(recorded_restarts)
    meta = {
        "name": name,
        "labels": {"pod-template-hash": template_hash, **(labels or {})},
        "annotations": annotations,
    }
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    conditions = [{"type": "Ready", "status": "False"}]
    if gate is not None:
        conditions.append({"type": MODELS_READY_CONDITION, "status": gate})
    return {
        "metadata": meta,
        "status": {
            "podIP": ip,
            "conditions": conditions,
            "containerStatuses": [
                {"name": "server", "ready": ready, "restartCount": restarts},
                {"name": "sidecar", "ready": False, "restartCount": 7},
            ],
        },
    }


RESNET = model_intent("resnet", {"serverRef": {"name": "pool"}, "modelName": "resnet50"})
BERT = model_intent("bert", {"serverRef": {"name": "pool"}, "version": 2})


def test_pod_facts_read_the_server_container_and_records():
    facts = pod_facts(
        pod_body(
            recorded={"resnet": {"model": "resnet50", "revision": "r1"}}, recorded_restarts=0, gate="True"
        )
    )
    assert facts.ip == "10.0.0.5" and facts.container_ready and facts.restarts == 0
    assert facts.recorded == {"resnet": Held("resnet50", "r1")}
    assert facts.has_record and not facts.restarted and facts.loadable and facts.gate == "True"
    assert not pod_facts(pod_body(deleting=True)).loadable
    assert not pod_facts(pod_body(ip=None)).loadable
    assert pod_facts(pod_body(restarts=2, recorded_restarts=1)).restarted


def test_garbage_annotations_are_ignored():
    body = pod_body()
    body["metadata"]["annotations"][PLACEMENTS_ANNOTATION] = "not json"
    assert pod_facts(body).recorded == {}
    body["metadata"]["annotations"][RESTARTS_ANNOTATION] = "x"
    assert pod_facts(body).recorded_restarts is None


def test_held_models_need_ready_entries_and_keep_recorded_revisions():
    facts = pod_facts(
        pod_body(recorded={"resnet": {"model": "resnet50", "revision": "r1"}}, recorded_restarts=0)
    )
    index = [
        IndexEntry("resnet50", "1", "READY"),
        IndexEntry("bert", "1", "READY"),
        IndexEntry("x", "1", "UNAVAILABLE"),
    ]
    # bert wants version 2 and the server has version 1 ready: a copy to reload in place
    assert held_models(facts, index, [RESNET, BERT]) == {"resnet": "r1", "bert": ""}
    recorded = {"bert": {"model": "bert", "revision": BERT.revision}}
    bert_facts = pod_facts(pod_body(recorded=recorded, recorded_restarts=0))
    assert held_models(bert_facts, index, [BERT]) == {"bert": ""}
    index.append(IndexEntry("bert", "2", "READY"))
    assert held_models(bert_facts, index, [BERT]) == {"bert": BERT.revision}
    assert held_models(facts, [IndexEntry("x", "1", "READY")], [RESNET]) == {}
    # after a restart the records are void: whatever is there has an unknown revision
    restarted = pod_facts(
        pod_body(
            restarts=1, recorded={"resnet": {"model": "resnet50", "revision": "r1"}}, recorded_restarts=0
        )
    )
    assert held_models(restarted, index, [RESNET]) == {"resnet": ""}


def test_pod_state():
    facts = pod_facts(pod_body(template_hash="h1"))
    index = [IndexEntry("resnet50", "1", "READY"), IndexEntry("other", "3", "READY")]
    state = pod_state(facts, index, [RESNET], current_hash="h2")
    assert state.ready and state.leaving and state.held == {"resnet": ""} and state.loaded_count == 2
    unreachable = pod_state(facts, None, [RESNET], current_hash="h1")
    assert not unreachable.ready and unreachable.held == {} and not unreachable.leaving


def test_current_template_hash_follows_the_deployment_revision():
    deployment = {"metadata": {"annotations": {"deployment.kubernetes.io/revision": "3"}}}
    replicasets = [
        {
            "metadata": {
                "annotations": {"deployment.kubernetes.io/revision": "2"},
                "labels": {"pod-template-hash": "a"},
            }
        },
        {
            "metadata": {
                "annotations": {"deployment.kubernetes.io/revision": "3"},
                "labels": {"pod-template-hash": "b"},
            }
        },
    ]
    assert current_template_hash(deployment, replicasets) == "b"
    assert current_template_hash(None, replicasets) is None
    assert current_template_hash({"metadata": {}}, replicasets) is None


def test_version_of_picks_the_highest_ready_version():
    index = [
        IndexEntry("m", "2", "READY"),
        IndexEntry("m", "10", "READY"),
        IndexEntry("m", "11", "UNAVAILABLE"),
    ]
    assert version_of(index, "m") == "10"
    assert version_of(index, "x") is None


def test_metadata_patch_adds_and_removes_model_labels():
    facts = pod_facts(
        pod_body(
            labels={"naiad.dev/model-old": "loaded", "naiad.dev/model-resnet": "loaded"},
            recorded={"old": {"model": "o", "revision": "1"}},
            recorded_restarts=0,
        )
    )
    truth = PodTruth(held={"resnet": Held("resnet50", "r2"), "bert": Held("bert", "r1")}, restarts=0)
    patch = metadata_patch(facts, truth)
    assert patch["metadata"]["labels"] == {"naiad.dev/model-old": None, "naiad.dev/model-bert": "loaded"}
    recorded = json.loads(patch["metadata"]["annotations"][PLACEMENTS_ANNOTATION])
    assert recorded == {
        "bert": {"model": "bert", "revision": "r1"},
        "resnet": {"model": "resnet50", "revision": "r2"},
    }
    assert RESTARTS_ANNOTATION not in patch["metadata"]["annotations"]


def test_metadata_patch_is_none_when_the_pod_already_tells_the_truth():
    recorded = {"resnet": {"model": "resnet50", "revision": "r2"}}
    facts = pod_facts(
        pod_body(
            labels={"naiad.dev/model-resnet": "loaded"}, recorded=recorded, recorded_restarts=3, restarts=3
        )
    )
    assert metadata_patch(facts, PodTruth(held={"resnet": Held("resnet50", "r2")}, restarts=3)) is None


def test_metadata_patch_records_restart_count_and_empty_placements_once():
    facts = pod_facts(pod_body(restarts=1))
    patch = metadata_patch(facts, PodTruth(held={}, restarts=1))
    assert patch == {"metadata": {"annotations": {PLACEMENTS_ANNOTATION: "{}", RESTARTS_ANNOTATION: "1"}}}


def test_gate_patch():
    facts = pod_facts(pod_body(gate="False"))
    patch = gate_patch(facts, True, "2024-01-01T00:00:00Z", "1 models loaded")
    assert patch["status"]["conditions"][0]["type"] == MODELS_READY_CONDITION
    assert patch["status"]["conditions"][0]["status"] == "True"
    assert gate_patch(pod_facts(pod_body(gate="True")), True, "now", "") is None
    assert gate_patch(pod_facts(pod_body()), False, "now", "")["status"]["conditions"][0]["status"] == "False"
