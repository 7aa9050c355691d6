"""Triton python-based backend 'reverse' (--backend-directory <dir>, <dir>/reverse/model.py), unchanged
from what Triton would load: every model whose config says backend: "reverse" runs this TritonPythonModel."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_name = args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.ascontiguousarray(x[..., ::-1]))])
            )
        return responses
