"""Pure renderer of the Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1) for an
LLM InferenceModel: the pods holding the model, the port `/v1` answers on, and the endpoint picker a gateway asks
which of them gets each request."""

from __future__ import annotations

from .llm import LLMSpec
from .naming import HTTP_PORT
from .objects import Body
from .ownership import Owner, child_metadata

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
INFERENCE_POOL_KIND = "InferencePool"
INFERENCE_POOL_PLURAL = "inferencepools"


def inference_pool_wanted(llm: LLMSpec | None, api_served: bool, setting: str) -> bool:
    """`setting` is the operator's NAIAD_INFERENCE_POOLS ("auto": when the cluster serves the API, "false":
    never); a model's `llm.inferencePool.enabled` turns it off (false) or asks for it (true) under "auto"."""
    if llm is None or setting == "false" or llm.inference_pool is False:
        return False
    return api_served


def render_inference_pool(
    owner: Owner, llm: LLMSpec, selector: dict[str, str], labels: dict[str, str]
) -> Body:
    """An InferencePool named after the model: `selector` is the model Service's (pods of its pool that hold the
    model), the target port is the pods' HTTP port (where `/v1` answers)."""
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": INFERENCE_POOL_KIND,
        "metadata": child_metadata(owner.name, owner, labels),
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": llm.endpoint_picker,
                "port": {"number": llm.endpoint_picker_port},
                "failureMode": llm.failure_mode,
            },
        },
    }
