"""What the LLM engine backends share: a decoupled, vLLM-shape model whose instances are engines that batch their
own sequences, taking each request with its response sender."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..config import ModelConfig
from ..errors import InvalidArgument
from ..inference import InferenceRequest
from ..llm.shape import auto_complete_vllm_shape
from .api import Backend, InstanceState, ModelState, ResponseSender


class Engine(Protocol):
    def submit(self, request: InferenceRequest, sender: ResponseSender) -> None: ...

    def close(self) -> None: ...


class EngineBackend(Backend):
    """A backend whose instance state is an engine (`engine_class(instance)`): Naiad's dynamic batcher stays out
    of its way (the config is auto-completed unbatched and decoupled, as Triton's vllm_backend does)."""

    default_model_filename = None
    engine_class: Any = None
    #: the load error of a model that is not decoupled
    decoupled_required = "the {backend} backend needs a decoupled transaction policy"

    def auto_complete_config(self, config: ModelConfig, model_file: Path | None) -> None:
        auto_complete_vllm_shape(config)

    def model_initialize(self, model: ModelState) -> None:
        if not model.decoupled:
            raise InvalidArgument(
                f"model '{model.name}': " + self.decoupled_required.format(backend=self.name)
            )

    def instance_initialize(self, instance: InstanceState) -> None:
        instance.state = self.engine_class(instance)

    def instance_execute(self, instance: InstanceState, requests: list[InferenceRequest]) -> None:
        engine: Engine = instance.state
        for request in requests:
            engine.submit(request, instance.sender(request))
        return None

    def instance_finalize(self, instance: InstanceState) -> None:
        engine = instance.state
        instance.state = None
        if engine is not None:
            engine.close()
