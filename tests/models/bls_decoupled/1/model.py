import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """BLS on a decoupled model: iterate over `repeat`'s responses and sum their indices."""

    def execute(self, requests):
        responses = []
        for request in requests:
            count = pb_utils.get_input_tensor_by_name(request, "COUNT")
            stream = pb_utils.InferenceRequest(
                model_name="repeat",
                requested_output_names=["IDX"],
                inputs=[pb_utils.Tensor("IN", np.array([1], np.int32)), count],
            ).exec(decoupled=True)
            total = 0
            for resp in stream:
                if resp.has_error():
                    raise pb_utils.TritonModelException(resp.error().message())
                idx = pb_utils.get_output_tensor_by_name(resp, "IDX")
                if idx is not None:
                    total += int(idx.as_numpy()[0])
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("SUM", np.array([total], np.int32))])
            )
        return responses
