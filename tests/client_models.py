"""A small model repository that both Naiad and the real Triton load: reshape, UINT64 identity, INT8 add/sub, ensembles."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRITON_MODELS = ROOT / "tools" / "triton" / "models"

#: The models loaded at start-up (--load-model), in load order (the ensemble after the model it composes).
CLIENT_MODELS = (
    "identity_fp32",
    "add_sub",
    "reshape_py",
    "reshape_nobatch",
    "identity_u64",
    "simple_int8",
    "ens_identity",
)
#: Models left unloaded at start-up: `ens_dep` composes `identity_dep`, which only the ensemble's load brings in.
LATER_MODELS = ("identity_dep", "ens_dep")

RESHAPE_MODEL = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """OUTPUT0 = INPUT0 as the model sees it; SEEN = the shape the model was given (one row per batch entry)."""

    def initialize(self, args):
        self.batched = json.loads(args["model_config"])["max_batch_size"] > 0

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            seen = np.array(x.shape, dtype=np.int64)
            if self.batched:
                seen = np.tile(seen, (x.shape[0], 1))
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUTPUT0", x), pb_utils.Tensor("SEEN", seen)]
                )
            )
        return responses
'''

RESHAPE_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 12 ] reshape {{ shape: [ 3, 4 ] }} }} ]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 12 ] reshape {{ shape: [ 3, 4 ] }} }},
  {{ name: "SEEN" data_type: TYPE_INT64 dims: [ -1 ] }}
]
"""

IDENTITY_U64_CONFIG = """
name: "identity_u64"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_UINT64 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_UINT64 dims: [ -1 ] } ]
"""

#: Triton's example model `simple_int8` (grpc_explicit_int8_content_client.py): add_sub's python model on INT8.
SIMPLE_INT8_CONFIG = """
name: "simple_int8"
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT8 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT8 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT8 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT8 dims: [ 16 ] }
]
"""

ENSEMBLE_CONFIG = """
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }} ]
ensemble_scheduling {{
  step [
    {{ model_name: "{step}" model_version: -1
      input_map {{ key: "INPUT0" value: "IN" }} output_map {{ key: "OUTPUT0" value: "OUT" }} }}
  ]
}}
"""


def build_client_repo(out: Path) -> Path:
    """Write the repository under `out` (replaced if present) and return it."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in ("identity_fp32", "add_sub"):
        shutil.copytree(TRITON_MODELS / name, out / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name, mbs in (("reshape_py", 8), ("reshape_nobatch", 0)):
        (out / name / "1").mkdir(parents=True)
        (out / name / "1" / "model.py").write_text(RESHAPE_MODEL)
        (out / name / "config.pbtxt").write_text(RESHAPE_CONFIG.format(name=name, max_batch_size=mbs))
    (out / "identity_u64" / "1").mkdir(parents=True)
    shutil.copy(TRITON_MODELS / "identity_fp32" / "1" / "model.py", out / "identity_u64" / "1" / "model.py")
    (out / "identity_u64" / "config.pbtxt").write_text(IDENTITY_U64_CONFIG)
    (out / "simple_int8" / "1").mkdir(parents=True)
    shutil.copy(TRITON_MODELS / "add_sub" / "1" / "model.py", out / "simple_int8" / "1" / "model.py")
    (out / "simple_int8" / "config.pbtxt").write_text(SIMPLE_INT8_CONFIG)
    shutil.copytree(
        TRITON_MODELS / "identity_fp32", out / "identity_dep", ignore=shutil.ignore_patterns("__pycache__")
    )
    config = (out / "identity_dep" / "config.pbtxt").read_text()
    (out / "identity_dep" / "config.pbtxt").write_text(config.replace('"identity_fp32"', '"identity_dep"'))
    for name, step in (("ens_identity", "identity_fp32"), ("ens_dep", "identity_dep")):
        (out / name / "1").mkdir(parents=True)
        (out / name / "config.pbtxt").write_text(ENSEMBLE_CONFIG.format(name=name, step=step))
    return out
