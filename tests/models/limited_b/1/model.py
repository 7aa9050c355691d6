import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Sleeps for the number of seconds it is given, then echoes it."""

    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = pb_utils.get_input_tensor_by_name(request, "SECONDS").as_numpy()
            time.sleep(float(seconds[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SECONDS_OUT", seconds)]))
        return responses
