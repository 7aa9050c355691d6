"""`backend: "llamacpp"`: GGUF models (`1/model.gguf`) served by llama.cpp with continuous batching, in the vLLM shape.

A bare `backend: "llamacpp"` config is completed to the tensors of Triton's vllm_backend (`text_input`, `stream`,
`sampling_parameters`, ... in; `text_output`, ... out; decoupled), so Triton's generate endpoints, its gRPC
streaming and Naiad's OpenAI frontend drive it unchanged. Each model instance owns one engine (engine.py); this
module turns requests into engine requests and engine outputs into responses as vllm_backend shapes them:
streaming deltas, or one response with the whole text (the prompt first unless `exclude_input_in_output`).
Parameters (config.pbtxt, string values): see params.MODEL_PARAMETERS and docs/llm.md. Structured output (vLLM's
`structured_outputs` sampling parameter) follows a GBNF grammar (grammar.py), so the OpenAI frontend's
`response_format` and forced `tool_choice` work on these models. LoRA adapters (lora.py) are loaded with the model
from its config and at runtime; a request names one by the `lora_name` sampling parameter (as Triton's vllm_backend
reads it), which the OpenAI frontend sets for `model: "<adapter>"`. Images (Triton vllm_backend's `image` input,
base64 strings) reach a model with a multimodal projector (multimodal.py: parameter `mmproj`, or `mmproj.gguf` in
the version folder), placed where the prompt has llama.cpp's marker `<__media__>`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ...config import ModelConfig
from ...errors import InvalidArgument, NaiadError
from ...inference import InferenceRequest
from ...llm import info as llm_info
from ...llm import vllm_request
from ...llm.images import decode as decode_image
from ...llm.metrics import EngineMetrics
from ...llm.shape import auto_complete_vllm_shape
from ..api import Backend, InstanceState
from .engine import GenerationRequest, LlamaEngine, Output
from .grammar import structured_grammar
from .lora import ModelAdapters, static_adapters
from .multimodal import Media, mmproj_path
from .params import engine_settings, sampling_params

log = logging.getLogger("naiad.llamacpp")


class LlamaCppBackend(Backend):
    """The backend object registered under `naiad.backends` as `llamacpp`."""

    name = "llamacpp"
    default_model_filename = "model.gguf"

    def auto_complete_config(self, config: ModelConfig, model_file: Path | None) -> None:
        auto_complete_vllm_shape(config)

    def model_initialize(self, model) -> None:
        if not model.decoupled:
            raise InvalidArgument(
                f"model '{model.name}': the llamacpp backend streams tokens, so the model must be decoupled "
                "(model_transaction_policy { decoupled: true }, which a bare config gets by auto-complete)"
            )
        engine_settings(model.parameters, version_dir=model.version_path)  # malformed ones fail the load here
        path = model.model_file
        if path is None or not path.is_file():
            raise InvalidArgument(f"model '{model.name}': no GGUF file at {path}")
        try:
            static = static_adapters(model.parameters, model.version_path)
            mmproj_path(model.parameters, model.version_path)
        except NaiadError as exc:
            raise InvalidArgument(f"model '{model.name}': {exc.message}") from None
        model.state = ModelAdapters(static, model.version_path)

    def instance_initialize(self, instance: InstanceState) -> None:
        model = instance.model
        settings = engine_settings(model.parameters, instance.instance_count, model.version_path)
        metrics = EngineMetrics(model.ctx.server, model.name, max_model_len=settings.n_ctx)
        adapters: ModelAdapters = model.state
        try:
            engine = LlamaEngine(model.model_file, settings, metrics)
        except BaseException:
            metrics.close()
            raise
        try:
            mmproj = mmproj_path(model.parameters, model.version_path)
            if mmproj is not None:
                engine.media = Media(engine, mmproj)
            adapters.add_engine(engine)
        except BaseException as exc:
            engine.close()
            metrics.close()
            if isinstance(exc, NaiadError):
                raise InvalidArgument(f"model '{model.name}': {exc.message}") from None
            raise
        instance.state = engine
        if llm_info.of(model.ctx) is None:
            info = llm_info.LLMInfo(
                chat_template=engine.chat_template(),
                bos_token=engine.special_text("bos"),
                eos_token=engine.special_text("eos"),
                context_length=settings.n_ctx,
                prompt_byte_limit=engine.prompt_byte_limit,
                tokenize=engine.tokenize,
                detokenize=engine.detokenize,
                check_structured_outputs=lambda spec: engine.check_grammar(structured_grammar(spec) or ""),
                extra={
                    "engine": "llama.cpp",
                    "n_parallel": settings.n_parallel,
                    "structured_outputs": True,
                },
                load_lora=adapters.load,
                unload_lora=adapters.unload,
            )
            if engine.media is not None:
                info.extra[llm_info.IMAGES] = {"marker": engine.media.marker}
            adapters.publish(info.extra)
            llm_info.publish(model.ctx, info)

    def instance_finalize(self, instance: InstanceState) -> None:
        engine: LlamaEngine | None = instance.state
        instance.state = None
        if engine is not None:
            if isinstance(instance.model.state, ModelAdapters):
                instance.model.state.remove_engine(engine)
            engine.close()
            engine.metrics.close()

    def instance_execute(self, instance: InstanceState, requests: list[InferenceRequest]) -> None:
        engine: LlamaEngine = instance.state
        for request in requests:
            sender = instance.sender(request)
            try:
                self._submit(instance, engine, request, sender)
            except Exception as exc:
                err = exc if isinstance(exc, NaiadError) else InvalidArgument(f"{type(exc).__name__}: {exc}")
                sender.send(error=err, final=True)
        return None

    def _submit(
        self, instance: InstanceState, engine: LlamaEngine, request: InferenceRequest, sender
    ) -> None:
        req = vllm_request.parse(request)
        if req.embedding is not None:
            self._embed(engine, req, sender)
            return
        prompt = req.prompt
        sampling = sampling_params(req.sampling)
        if req.returns & {"return_logprobs", "return_cumulative_logprob"} and sampling.logprobs is None:
            sampling.logprobs = 0
        media = None
        if req.images:
            if engine.media is None:
                raise InvalidArgument(
                    f"model '{instance.model.name}' is not multimodal: it takes no images (it has no mmproj, the "
                    "multimodal projector GGUF)"
                )
            decoded = [(data, decode_image(data, f"image {i + 1}")) for i, data in enumerate(req.images)]
            media = engine.media.tokenize(prompt, decoded)
            tokens = media.tokens
            # the frontend fills max_tokens in from the text's tokens alone: with images, what the context leaves
            if sampling.max_tokens is not None and len(tokens) < engine.n_ctx:
                sampling.max_tokens = min(sampling.max_tokens, engine.n_ctx - len(tokens))
        else:
            tokens = engine.tokenize(prompt)  # PromptTooLong, untokenized, past the byte bound
        pending: list[str] = []  # the whole text, when not streaming
        state = {"tokens": 0, "cumulative": 0.0}
        logprobs: list[dict] = []  # since the last response

        def send(text: str, finish: str | None) -> None:
            out = vllm_request.outputs(
                req,
                text,
                finish_reason=finish,
                cumulative_logprob=state["cumulative"],
                logprobs=logprobs,
                num_input_tokens=len(tokens),
                num_output_tokens=state["tokens"],
            )
            sender.send(out, final=finish is not None)

        def emit(o: Output) -> None:
            if o.logprobs:
                for entry in o.logprobs:
                    state["cumulative"] += next(iter(entry.values()))["logprob"]
                logprobs.extend(o.logprobs)
            state["tokens"] += o.tokens
            if req.stream:
                # a token that is no text yet (a partial UTF-8 character, a possible stop string) is counted,
                # with its logprob, in the next delta that carries text
                if o.text or o.finish_reason is not None:
                    send(o.text, o.finish_reason)
                    state["tokens"] = 0
                    logprobs.clear()
                return
            pending.append(o.text)
            if o.finish_reason is not None:
                send((prompt if req.prepend_input else "") + "".join(pending), o.finish_reason)

        def fail(exc: BaseException) -> None:
            sender.send(error=exc, final=True)

        engine.submit(
            GenerationRequest(
                prompt=tokens,
                sampling=sampling,
                emit=emit,
                fail=fail,
                cancelled=sender.is_cancelled,
                media=media,
            )
        )

    def _embed(self, engine: LlamaEngine, req: vllm_request.VllmRequest, sender) -> None:
        if not engine.settings.embeddings:
            raise InvalidArgument(
                "embeddings are turned off for this model (parameter 'embeddings' is false)"
            )
        spec = req.embedding or {}
        text = spec.get("input")
        if isinstance(text, list) and all(isinstance(t, int) for t in text):
            raise InvalidArgument("the llamacpp backend embeds text: give 'input' as a string")
        if not isinstance(text, str):
            raise InvalidArgument("embedding_request 'input' must be a string")
        vector = engine.embed(text)
        dims = (spec.get("pooling_params") or {}).get("dimensions")
        if dims is not None:
            if not isinstance(dims, int) or not 0 < dims <= len(vector):
                raise InvalidArgument(f"pooling_params.dimensions must be an integer in [1, {len(vector)}]")
            vector = vector[:dims]
        n_input = len(engine.tokenize(text)) if "return_num_input_tokens" in req.returns else 0
        sender.send(vllm_request.outputs(req, json.dumps(vector), num_input_tokens=n_input), final=True)


backend = LlamaCppBackend()
