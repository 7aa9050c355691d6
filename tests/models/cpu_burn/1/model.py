import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """CPU-bound pure-Python work that holds the GIL: ITERATIONS loop steps per request.

    Returns a checksum of the loop and the pid of the process that ran it, so tests can tell
    in-process from process-isolated instances (and kill a worker)."""

    def execute(self, requests):
        responses = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "ITERATIONS").as_numpy().reshape(-1)[0])
            total = 0
            for i in range(n):
                total = (total + i * i) % 1000003
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("RESULT", np.array([total], dtype=np.int64)),
                        pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
                    ]
                )
            )
        return responses
