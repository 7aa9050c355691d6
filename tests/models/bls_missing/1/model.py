import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """BLS to a model that does not exist: the error comes back in the response, and is reported."""

    def execute(self, requests):
        responses = []
        for request in requests:
            resp = pb_utils.InferenceRequest(
                model_name="no_such_model",
                requested_output_names=["X"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")],
            ).exec()
            responses.append(
                pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("BLS failed: " + resp.error().message())
                )
                if resp.has_error()
                else resp
            )
        return responses
