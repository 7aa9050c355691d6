"""Shared model.py of the scheduler probe models (copied into each by build_models.py).

OUTPUT0 echoes INPUT0; BATCH is how many requests `execute` received together; ORDER is a per-instance
execution counter; WARMED counts the warmup requests this instance ran. Sleeps `sleep_s` (config parameter).
"""

import itertools
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.sleep = float(config.get("parameters", {}).get("sleep_s", {}).get("string_value", "0") or 0)
        self.order = itertools.count(1)
        self.warmed = 0

    def execute(self, requests):
        if all(r.request_id().startswith("warmup") for r in requests):
            self.warmed += len(requests)
        if self.sleep:
            time.sleep(self.sleep)
        order = next(self.order)
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            rows = x.shape[0]
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUTPUT0", x),
                        pb_utils.Tensor("BATCH", np.full((rows, 1), len(requests), np.int32)),
                        pb_utils.Tensor("ORDER", np.full((rows, 1), order, np.int32)),
                        pb_utils.Tensor("WARMED", np.full((rows, 1), self.warmed, np.int32)),
                    ]
                )
            )
        return responses
