import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """BLS: calls add_sub twice (sync and async) and returns (a+b) + (a-b) = 2a."""

    async def execute(self, requests):
        responses = []
        for request in requests:
            inputs = [
                pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                pb_utils.get_input_tensor_by_name(request, "INPUT1"),
            ]
            sync = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT0"], inputs=inputs
            ).exec()
            if sync.has_error():
                raise pb_utils.TritonModelException(sync.error().message())
            later = await pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT1"], inputs=inputs
            ).async_exec()
            total = (
                pb_utils.get_output_tensor_by_name(sync, "OUTPUT0").as_numpy()
                + pb_utils.get_output_tensor_by_name(later, "OUTPUT1").as_numpy()
            )
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", total)]))
        return responses
