"""The `vllm` backend: Triton's vLLM model layout served by vLLM's AsyncLLM engine inside the server process.

A model is Triton's vllm_backend layout: `config.pbtxt` with `backend: "vllm"` (a bare one is completed to the vLLM
shape, decoupled, max_batch_size 0) and `<version>/model.json` holding vLLM's engine arguments (`AsyncEngineArgs`:
`model`, `tensor_parallel_size`, `pipeline_parallel_size`, `gpu_memory_utilization`, `max_model_len`, ...), passed
through as they are. The config's `parameters` `tensor_parallel_size` / `pipeline_parallel_size` (positive integers)
and `distributed_executor_backend` override model.json's, so a load with a `config` override can size the engine to the GPUs it was given without
rewriting the repository (the operator does so for an InferenceModel's `llm.parallelism`); Triton's python-based
vllm_backend reads model.json only. Unlike Triton's python-based vllm_backend there is no stub process: requests go from the
server straight to the engine, which runs on an asyncio loop thread of its own per instance.

Requests are in the vLLM shape: `sampling_parameters` (JSON, or the request's parameters) become vLLM's
SamplingParams, `stream` sends deltas, `exclude_input_in_output` and the `return_*` outputs are vllm_backend's, a
cancelled request is aborted in the engine, `embedding_request` goes to `encode()` for pooling models. Token metrics
(`naiad.llm.metrics`) come from the requests; the KV-cache gauge from vLLM's own scheduler stats. The engine's
tokenizer gives the LLMInfo (chat template, special tokens, `max_model_len`) the OpenAI frontend reads.

A `--backend-directory` holding `vllm/model.py` (Triton's vllm_backend, unmodified) takes precedence over this
built-in, as in Triton: the registry looks in the backend directory first.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument, NaiadError, Unavailable
from ..inference import InferenceRequest
from ..llm import info as llm_info
from ..llm import limits, multi_lora, vllm_request
from ..llm.metrics import EngineMetrics
from .api import InstanceState, ResponseSender
from .engine_backend import EngineBackend

log = logging.getLogger("naiad.vllm")

ENGINE_ARGS_FILENAME = "model.json"
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def engine_arguments(version_dir: Path, model_name: str) -> dict[str, Any]:
    """`model.json` of a version folder: vLLM's engine arguments as a JSON object."""
    path = version_dir / ENGINE_ARGS_FILENAME
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument(
            f"model '{model_name}': '{ENGINE_ARGS_FILENAME}' containing vllm engine args must be provided in "
            f"'{version_dir}'"
        ) from None
    except ValueError as exc:
        raise InvalidArgument(f"model '{model_name}': {path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"model '{model_name}': {path} must hold a JSON object of engine arguments")
    return value


def lora_repository(arguments: dict[str, Any], version_dir: Path, model_name: str) -> dict[str, str]:
    """Triton vllm_backend's adapters: with `enable_lora` in model.json, multi_lora.json in the version folder
    names them (name -> a PEFT adapter folder; a relative path is the version folder's); {} without enable_lora."""
    if str(arguments.get("enable_lora", False)).lower() != "true":
        return {}
    entries = multi_lora.read(version_dir)
    if entries is None:
        raise InvalidArgument(
            f"model '{model_name}': enable_lora is set in {ENGINE_ARGS_FILENAME} but "
            f"{version_dir / multi_lora.FILE} is missing"
        )
    out: dict[str, str] = {}
    for name, raw in entries:
        multi_lora.check_name(name)
        if not isinstance(raw, str) or not raw:
            raise InvalidArgument(f"{multi_lora.FILE}: LoRA adapter '{name}' needs a path")
        path = Path(raw).expanduser()
        out[name] = str(path if path.is_absolute() else version_dir / path)
    return out


# Config parameters that override model.json's engine argument of the same name.
PARALLELISM_PARAMETERS = ("tensor_parallel_size", "pipeline_parallel_size")
# ... and how the engine runs its workers over them: "ray" when they span the pods of a group (llm/ray_group.py)
EXECUTOR_PARAMETER = "distributed_executor_backend"
EXECUTOR_BACKENDS = ("ray", "mp", "uni", "external_launcher")


def parameter_overrides(parameters: dict[str, str], model_name: str) -> dict[str, int | str]:
    """The engine arguments the config's `parameters` set over model.json's: the parallel sizes and the
    distributed executor."""
    overrides: dict[str, int | str] = {}
    for key in PARALLELISM_PARAMETERS:
        if key not in parameters:
            continue
        value = parameters[key].strip()
        if not value.isdigit() or int(value) < 1:
            raise InvalidArgument(
                f"model '{model_name}': config parameter '{key}' must be a positive integer, got {value!r}"
            )
        overrides[key] = int(value)
    if EXECUTOR_PARAMETER in parameters:
        executor = parameters[EXECUTOR_PARAMETER].strip()
        if executor not in EXECUTOR_BACKENDS:
            raise InvalidArgument(
                f"model '{model_name}': config parameter '{EXECUTOR_PARAMETER}' must be one of "
                f"{', '.join(EXECUTOR_BACKENDS)}, got {executor!r}"
            )
        overrides[EXECUTOR_PARAMETER] = executor
    return overrides


def _stat_logger_factory(metrics: EngineMetrics):
    """A vLLM stat-logger factory whose loggers put the scheduler's KV-cache usage on the engine's gauge."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class KvCacheLogger(StatLoggerBase):
        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                metrics.set_kv_cache_usage(float(getattr(scheduler_stats, "kv_cache_usage", 0.0)))

        def log_engine_initialized(self) -> None:
            return None

    def factory(vllm_config, engine_index: int = 0):
        return KvCacheLogger(vllm_config, engine_index)

    return factory


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class Engine:
    """One instance's AsyncLLM on its own event loop thread."""

    def __init__(self, instance: InstanceState):
        from vllm.engine.arg_utils import AsyncEngineArgs

        model = instance.model
        self.name = model.name
        arguments = engine_arguments(model.version_path, model.name)
        arguments.update(parameter_overrides(model.parameters, model.name))
        parallel = int(arguments.get("tensor_parallel_size", 1)) * int(
            arguments.get("pipeline_parallel_size", 1)
        )
        if parallel > 1 and instance.kind == "GPU":
            raise InvalidArgument(
                f"model '{model.name}': KIND_GPU is for single-GPU engines; use KIND_MODEL for "
                "tensor_parallel_size * pipeline_parallel_size > 1"
            )
        if instance.kind == "GPU":  # as vllm_backend: the engine's workers see the instance's GPU only
            os.environ["CUDA_VISIBLE_DEVICES"] = str(instance.device_id)
        try:
            self.args = AsyncEngineArgs(**arguments)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"model '{model.name}': bad engine arguments in model.json: {exc}"
            ) from None
        self.metrics = EngineMetrics(
            model.ctx.server, model.name, int(arguments.get("max_model_len") or 65536)
        )
        self.loras = lora_repository(arguments, model.version_path, model.name)
        self.max_loras = int(arguments.get("max_loras", 1))
        self._lora_running: collections.Counter[str] = collections.Counter()
        self.max_prompt_bytes = limits.max_prompt_bytes_parameter(model.parameters)
        self.prompt_byte_limit: int | None = None
        self._ids = itertools.count()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"vllm-{model.name}", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(model.ctx), self.loop).result()
        except BaseException:
            self._stop_loop()
            raise

    async def _start(self, ctx: Any) -> None:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        usage = UsageContext.OPENAI_API_SERVER
        vllm_config = self.args.create_engine_config(usage_context=usage)
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=usage,
            stat_loggers=[_stat_logger_factory(self.metrics)],
            disable_log_stats=False,
        )
        self.tasks = tuple(await _maybe_await(self.engine.get_supported_tasks()))
        self.context_length = int(vllm_config.model_config.max_model_len)
        tokenizer = await _maybe_await(self.engine.get_tokenizer())
        self.tokenizer = tokenizer
        self.prompt_byte_limit = limits.tokenizer_byte_limit(
            tokenizer, self.context_length, self.max_prompt_bytes
        )
        llm_info.publish(
            ctx,
            llm_info.LLMInfo(
                chat_template=getattr(tokenizer, "chat_template", None),
                bos_token=getattr(tokenizer, "bos_token", None) or "",
                eos_token=getattr(tokenizer, "eos_token", None) or "",
                context_length=self.context_length,
                prompt_byte_limit=self.prompt_byte_limit,
                tokenize=lambda text, add_special=False: list(
                    tokenizer.encode(text, add_special_tokens=add_special)
                ),
                detokenize=lambda ids: tokenizer.decode(ids),
                extra={llm_info.LORA_ADAPTERS: dict(self.loras)} if self.loras else {},
            ),
        )

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            self.loop.call_soon_threadsafe(engine.shutdown)
        self._stop_loop()
        self.metrics.close()

    def submit(self, request: InferenceRequest, sender: ResponseSender) -> None:
        try:
            req = vllm_request.parse(request)
            task = "embed" if req.embedding is not None else "generate"
            if task == "generate":  # refused before vLLM's tokenizer sees it (llm/limits.py)
                limits.check_prompt(req.prompt, self.prompt_byte_limit, self.context_length)
            if task not in self.tasks:
                raise InvalidArgument(f"Model {self.name} does not support '{task}' request")
            if req.images:
                raise InvalidArgument(
                    f"model '{self.name}': the vllm backend does not take images yet (the llamacpp and "
                    "transformers backends do; see docs/llm.md)"
                )
        except NaiadError as exc:
            sender.send(error=exc, final=True)
            return
        work = self._embed(req, sender) if req.embedding is not None else self._generate(req, sender)
        asyncio.run_coroutine_threadsafe(work, self.loop)

    async def _embed(self, req: vllm_request.VllmRequest, sender: ResponseSender) -> None:
        from vllm.pooling_params import PoolingParams

        try:
            spec = req.embedding or {}
            prompt = spec["input"]
            if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
                prompt = {"prompt_token_ids": prompt}
            elif not isinstance(prompt, str):
                raise InvalidArgument("embedding_request 'input' must be a string or a list of token ids")
            dims = spec.get("pooling_params", {}).get("dimensions")
            if dims:
                params = PoolingParams(
                    task="embed", dimensions=int(dims[0] if isinstance(dims, list) else dims)
                )
            else:
                params = PoolingParams(task="embed")
            last = None
            async for output in self.engine.encode(prompt, params, f"naiad-embed-{next(self._ids)}"):
                last = output
            if last is None:
                raise Unavailable(f"model '{self.name}': the engine returned no embedding")
            data = last.outputs.data
            vector = data.tolist() if hasattr(data, "tolist") else list(data)
            out = vllm_request.outputs(req, json.dumps(vector), num_input_tokens=len(last.prompt_token_ids))
            sender.send(out, final=True)
        except Exception as exc:
            sender.send(error=exc, final=True)

    async def _generate(self, req: vllm_request.VllmRequest, sender: ResponseSender) -> None:
        from vllm.sampling_params import SamplingParams

        metrics = self.metrics.arrived()
        rid = f"naiad-{next(self._ids)}"
        prompt_tokens = generated = 0
        finish = "abort"
        reader: asyncio.Task | None = None
        lora_name: str | None = None
        counted = False  # in vllm:lora_requests_info
        try:
            sampling = dict(req.sampling)
            lora_name = sampling.pop("lora_name", None)
            lora_request = self._lora_request(lora_name)
            try:
                params = SamplingParams(**sampling)
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(f"bad sampling parameters: {exc}") from None
            outputs: asyncio.Queue = asyncio.Queue()
            self._lora_started(lora_name)
            counted = True

            async def read() -> None:
                try:
                    async for item in self.engine.generate(
                        req.prompt, params, rid, lora_request=lora_request
                    ):
                        outputs.put_nowait(item)
                except Exception as exc:
                    outputs.put_nowait(exc)
                outputs.put_nowait(None)

            reader = asyncio.get_running_loop().create_task(read())
            sent_text = sent_tokens = sent_logprobs = 0
            last = None
            while True:
                try:
                    item = await asyncio.wait_for(outputs.get(), timeout=0.25)
                except TimeoutError:
                    item = False
                if sender.is_cancelled():
                    await self.engine.abort(rid)
                    return
                if item is False:
                    continue
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                last = item
                completion = item.outputs[0]
                metrics.scheduled()
                prompt_tokens = len(item.prompt_token_ids or [])
                metrics.tokens(len(completion.token_ids) - generated)
                generated = len(completion.token_ids)
                if item.finished:
                    finish = _FINISH.get(str(completion.finish_reason), "stop")
                if req.stream:
                    out = vllm_request.outputs(
                        req,
                        completion.text[sent_text:],
                        finish_reason=completion.finish_reason,
                        cumulative_logprob=completion.cumulative_logprob,
                        logprobs=_logprobs(completion, sent_logprobs),
                        num_input_tokens=prompt_tokens,
                        num_output_tokens=generated - sent_tokens,
                    )
                    sent_text, sent_tokens = len(completion.text), generated
                    sent_logprobs = len(completion.logprobs or [])
                    sender.send(out, final=item.finished)
                if item.finished:
                    break
            if last is None:
                raise Unavailable(f"model '{self.name}': the engine ended the request without output")
            if not req.stream:
                completion = last.outputs[0]
                text = ((last.prompt or "") if req.prepend_input else "") + completion.text
                out = vllm_request.outputs(
                    req,
                    text,
                    finish_reason=completion.finish_reason,
                    cumulative_logprob=completion.cumulative_logprob,
                    logprobs=_logprobs(completion, 0),
                    num_input_tokens=prompt_tokens,
                    num_output_tokens=generated,
                )
                sender.send(out, final=True)
            elif not last.finished:
                sender.send(final=True)
        except Exception as exc:
            sender.send(error=exc, final=True)
        finally:
            if reader is not None and not reader.done():
                reader.cancel()
            if counted:
                self._lora_ended(lora_name)
            metrics.finished(prompt_tokens, generated, finish)

    def _lora_request(self, name: Any) -> Any:
        """The LoRARequest for sampling parameter `lora_name`, as Triton's vllm_backend builds it (id: the adapter's
        place in multi_lora.json, from 1); None without one. Its errors are vllm_backend's."""
        if name is None:
            return None
        if not self.loras:
            raise InvalidArgument("LoRA feature is not enabled.")
        if name not in self.loras:
            raise InvalidArgument(f"LoRA {name} is not supported, we currently support {list(self.loras)}")
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, list(self.loras).index(name) + 1, self.loras[name])

    def _lora_started(self, name: str | None) -> None:
        if self.loras:
            if name is not None:
                self._lora_running[name] += 1
            self._publish_lora()

    def _lora_ended(self, name: str | None) -> None:
        if self.loras:
            if name is not None:
                self._lora_running[name] -= 1
                if self._lora_running[name] <= 0:
                    del self._lora_running[name]
            self._publish_lora()

    def _publish_lora(self) -> None:
        """vllm:lora_requests_info: the adapters of the requests in the engine (vLLM's scheduler splits running
        from waiting; from outside it, every request handed to the engine counts as running)."""
        self.metrics.set_lora(sorted(self._lora_running), [], self.max_loras)


def _logprobs(completion: Any, start: int) -> list[dict[str, Any]] | None:
    """vllm_backend's `logprobs` output: per token, {token id: {logprob, rank, decoded_token}}."""
    if completion.logprobs is None:
        return None
    return [
        {
            str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token, lp in step.items()
        }
        for step in completion.logprobs[start:]
    ]


class VllmBackend(EngineBackend):
    """`backend: "vllm"`: see the module docstring."""

    name = "vllm"
    engine_class = Engine
    decoupled_required = (
        "vLLM backend must be configured to use decoupled model transaction policy"  # Triton's
    )

    def model_initialize(self, model) -> None:
        super().model_initialize(model)
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise InvalidArgument(
                f"model '{model.name}': the vllm backend needs the vllm package (pip install 'naiad[vllm]'): {exc}"
            ) from None


backend = VllmBackend()
