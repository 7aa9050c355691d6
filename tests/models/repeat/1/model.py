import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled: sends COUNT responses (IN, index), half from execute and half from a thread after it
    returned, then the final flag alone. COUNT < 0 sends an error response."""

    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            if count < 0:
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError("negative COUNT")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue

            def send(i, sender=sender, value=value):
                sender.send(
                    pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUT", value), pb_utils.Tensor("IDX", np.array([i], np.int32))]
                    )
                )

            first = count // 2
            for i in range(first):
                send(i)

            def rest(first=first, count=count, send=send, sender=sender):
                for i in range(first, count):
                    send(i)
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

            threading.Thread(target=rest).start()
        return None
