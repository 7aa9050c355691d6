"""Implicit-state accumulator: OUTPUT = OUTPUT_STATE = INPUT + INPUT_STATE; the server keeps the state."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            state = pb_utils.get_input_tensor_by_name(request, "INPUT_STATE").as_numpy()
            total = (x + state).astype(x.dtype)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT", total.copy()), pb_utils.Tensor("OUTPUT_STATE", total)]
                )
            )
        return responses
