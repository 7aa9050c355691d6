import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled: sends IN back COUNT times, the final flag with the last response (not alone)."""

    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(count):
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == count - 1 else 0
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]), flags=flags)
        return None
