"""MLServer custom runtimes equivalent to the benchmark model repository (bench/models/repo).

IdentityRuntime   == identity_16 / identity_64k (python backend): OUTPUT0 = INPUT0, FP32.
OnnxMLPRuntime    == mlp / mlp_batched: the same ONNX file, onnxruntime CPU, one intra-op thread.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class IdentityRuntime(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        arr = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32, copy=False)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[NumpyCodec.encode_output("OUTPUT0", arr)],
        )


class OnnxMLPRuntime(MLModel):
    async def load(self) -> bool:
        uri = await get_model_uri(self.settings)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self._session = ort.InferenceSession(uri, opts, providers=["CPUExecutionProvider"])
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32, copy=False)
        (y,) = self._session.run(["OUTPUT0"], {"INPUT0": x})
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[NumpyCodec.encode_output("OUTPUT0", y)],
        )
