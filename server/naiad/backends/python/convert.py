"""What a python model returns (pb_utils objects) turned into the server's responses.

The glue between `triton_python_backend_utils` and the server: it reads the pb_utils objects' fields directly
(it is their other half), so that neither the public module nor the instances carry the conversion.
"""

from __future__ import annotations

from ... import errors
from ...device_tensors import DeviceTensor
from ...errors import NaiadError
from ...inference import InferenceResponse, OutputTensor

# pb_utils.TritonError codes -> the server's errors (and so HTTP statuses and gRPC codes)
_ERROR_NAMES = {
    2: "NotFound",  # NOT_FOUND
    3: "InvalidArgument",  # INVALID_ARG
    4: "Unavailable",  # UNAVAILABLE
    5: "Unsupported",  # UNSUPPORTED
    6: "AlreadyExists",  # ALREADY_EXISTS
    7: "Cancelled",  # CANCELLED
}


def naiad_error(err) -> NaiadError:
    """The server's error for a pb_utils.TritonError, by its code (Internal for UNKNOWN and INTERNAL)."""
    return getattr(errors, _ERROR_NAMES.get(err.code(), "Internal"))(err.message())


def to_native(request, response, final: bool) -> InferenceResponse:
    """The server's response to `request` (a pb_utils.InferenceRequest the model received) from the model's
    pb_utils.InferenceResponse (None: only the end of a decoupled stream); only requested outputs go out."""
    native = request._native
    if response is None:
        return InferenceResponse(
            model_name=native.model_name, model_version=str(native.model_version), id=native.id, final=final
        )
    if response.has_error():
        return InferenceResponse(
            model_name=native.model_name,
            model_version=str(native.model_version),
            id=native.id,
            error=naiad_error(response.error()),
            final=final,
        )
    requested = set(request._requested) if native.outputs else None
    outputs = []
    device = False
    for t in response.output_tensors():
        if requested is None or t.name() in requested:
            device = device or t._array.__class__ is DeviceTensor
            outputs.append(OutputTensor(t.name(), t._datatype, t._array))
    return InferenceResponse(
        model_name=native.model_name,
        model_version=str(native.model_version),
        outputs=outputs,
        id=native.id,
        parameters=response._parameters,
        final=final,
        device_outputs=device,
    )
