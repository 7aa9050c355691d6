"""Sequence accumulator keyed by the CONTROL_SEQUENCE_CORRID input: running sum per sequence, per instance.

Checks what the sequence batcher feeds it: START/END/READY controls agree with the request flags, CORRID
with the request's correlation ID, control shapes are [1] ([1, 1] when batched). A non-START request for a
sequence this instance has not seen (a routing error) and a negative INPUT answer with an error.
Parameter `delay_ms` makes every execution sleep, so that concurrent sequences batch.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        self.delay = float(params.get("delay_ms", {}).get("string_value", "0")) / 1000.0
        self.batched = int(config.get("max_batch_size", 0)) > 0
        self.sums = {}

    def _one(self, request):
        def get(name):
            arr = pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            shape = (1, 1) if self.batched else (1,)
            if name != "INPUT" and arr.shape != shape:
                raise ValueError(f"control {name} has shape {list(arr.shape)}, expected {list(shape)}")
            return arr.reshape(-1)[0]

        value = int(get("INPUT"))
        start, end, ready = bool(get("START")), bool(get("END")), bool(get("READY"))
        corrid = get("CORRID")
        corrid = corrid.decode() if isinstance(corrid, bytes) else int(corrid)
        flags = request.flags()
        if start != bool(flags & 1) or end != bool(flags & 2) or not ready:
            raise ValueError(f"controls START={start} END={end} READY={ready} do not match flags {flags}")
        if str(corrid) != str(request.correlation_id()):  # a TYPE_STRING CORRID spells a numeric ID
            raise ValueError(f"CORRID {corrid!r} is not the correlation ID {request.correlation_id()!r}")
        if value < 0:
            raise ValueError(f"negative input {value}")
        if start:
            self.sums[corrid] = 0
        elif corrid not in self.sums:
            raise ValueError(f"sequence {corrid!r} was not started on this instance")
        self.sums[corrid] += value
        total = self.sums[corrid]
        if end:
            del self.sums[corrid]
        out = np.array([[total]] if self.batched else [total], dtype=np.int32)
        return pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)])

    def execute(self, requests):
        if self.delay:
            time.sleep(self.delay)
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses
