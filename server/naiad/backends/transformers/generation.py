"""The transformers backend's generation engine: a causal language model served with transformers' own continuous
batching (`ContinuousBatchingManager`), requests and responses in the vLLM shape (see the package's docstring)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
from typing import Any

from ...errors import InvalidArgument, NaiadError, Unavailable
from ...inference import InferenceRequest
from ...llm import info as llm_info
from ...llm import limits, vllm_request
from ...llm.metrics import EngineMetrics
from ..api import InstanceState, ResponseSender
from . import vision
from .grammar import GrammarSampling
from .kv_cache import KVCacheSampler
from .seed import SeededSampling
from .text import safe_end as _safe_end

log = logging.getLogger("naiad.transformers")

_DEFAULTS = {"max_num_seqs": 16, "num_blocks": 256, "block_size": 32, "max_batch_tokens": 512}


def _int_parameter(params: dict[str, str], key: str) -> int:
    value = params.get(key, "") or str(_DEFAULTS[key])
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgument(f"parameter '{key}' must be an integer, got '{value}'") from None
    if number < 1:
        raise InvalidArgument(f"parameter '{key}' must be at least 1, got {number}")
    return number


def start_manager(model: Any, settings: dict[str, int], pad_token_id: int, eos_token_id: int | None) -> Any:
    """transformers' continuous-batching manager over `model`, started: `settings` are the config parameters
    `max_num_seqs`, `num_blocks`, `block_size` and `max_batch_tokens` (bench/llm/transformers_bench.py calls this too,
    so its in-process way is configured as the backend is)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Sampling: one manager-wide mode; temperature, top_k and top_p per request (the processors exist only
    # when the generation config's values are not the neutral ones, hence 0.5 / vocab / 0.99 here).
    generation = GenerationConfig(
        do_sample=True,
        temperature=0.5,
        top_k=model.config.get_text_config().vocab_size,
        top_p=0.99,
        max_new_tokens=16,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
    )
    batching = ContinuousBatchingConfig(
        block_size=settings["block_size"],
        num_blocks=settings["num_blocks"],
        max_batch_tokens=settings["max_batch_tokens"],
        max_requests_per_batch=settings["max_num_seqs"],
        per_request_processors=True,
        use_cuda_graph=False,
    )
    manager = model.init_continuous_batching(
        generation_config=generation, continuous_batching_config=batching
    )
    manager.start()
    return manager


class Engine:
    """One instance's model, tokenizer and continuous-batching manager, with an asyncio loop thread on which
    the requests wait for their tokens."""

    def __init__(self, instance: InstanceState):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = instance.model
        folder = model.version_path
        if not (folder / "config.json").is_file():
            raise InvalidArgument(
                f"model '{model.name}': {folder} holds no config.json (a Hugging Face model folder)"
            )
        params = model.parameters
        self.device = f"cuda:{instance.device_id}" if instance.kind == "GPU" else "cpu"
        dtype_name = params.get("dtype", "") or ("float32" if self.device == "cpu" else "auto")
        if dtype_name not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidArgument(
                f"parameter 'dtype' must be float32, bfloat16, float16 or auto, got '{dtype_name}'"
            )
        dtype = dtype_name if dtype_name == "auto" else getattr(torch, dtype_name)
        self.torch = torch
        self.images: vision.ImageGeneration | None = None  # a vision-language model's requests with images
        if vision.is_vision_model(folder):
            processor, loaded = vision.load(folder, dtype)
            self.model = loaded.to(self.device).eval()
            self.tokenizer = processor.tokenizer
            self.images = vision.ImageGeneration(self, processor)
            chat_template = getattr(processor, "chat_template", None) or getattr(
                self.tokenizer, "chat_template", None
            )
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(self.device).eval()
            chat_template = getattr(self.tokenizer, "chat_template", None)
        config = self.model.config.get_text_config()
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.vocab_size = int(config.vocab_size)
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.name = model.name
        self.metrics = EngineMetrics(model.ctx.server, model.name, self.context_length or 65536)
        self.max_sequences = 1  # the most sequences one forward has carried
        self.model.register_forward_pre_hook(self._count_sequences, with_kwargs=True)
        self.manager = start_manager(
            self.model,
            {key: _int_parameter(params, key) for key in _DEFAULTS},
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0,
            eos_token_id=self.eos_ids[0] if self.eos_ids else None,
        )
        self.seeds = SeededSampling(self.manager, self.device)
        self.grammars = GrammarSampling(self.manager, self.tokenizer, self.vocab_size)
        self._ids = itertools.count()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name=f"transformers-{model.name}", daemon=True
        )
        self._thread.start()
        self.kv_cache = KVCacheSampler(self.manager, self.metrics, self.loop)
        self.kv_cache.start()
        tok = self.tokenizer
        self.prompt_byte_limit = limits.tokenizer_byte_limit(
            tok, self.context_length, limits.max_prompt_bytes_parameter(params)
        )
        llm_info.publish(
            model.ctx,
            llm_info.LLMInfo(
                chat_template=chat_template,
                bos_token=tok.bos_token or "",
                eos_token=tok.eos_token or "",
                context_length=self.context_length,
                prompt_byte_limit=self.prompt_byte_limit,
                tokenize=lambda text, add_special=False: list(
                    tok(text, add_special_tokens=add_special)["input_ids"]
                ),
                detokenize=lambda ids: tok.decode(ids),
                check_structured_outputs=self.grammars.compile,
                extra={
                    "engine": "transformers",
                    "structured_outputs": True,
                    # a Hugging Face template: images as {"type": "image"} parts (it writes the image token)
                    **({llm_info.IMAGES: {"marker": None}} if self.images is not None else {}),
                },
            ),
        )

    def _count_sequences(self, module: Any, args: Any, kwargs: dict) -> None:
        lens = kwargs.get("cu_seq_lens_q")
        if lens is not None and len(lens) - 1 > self.max_sequences:
            self.max_sequences = len(lens) - 1
            log.info("model '%s': %d sequences in one forward", self.name, self.max_sequences)

    def close(self) -> None:
        if self.images is not None:
            self.images.close()
        self.kv_cache.close()
        self.manager.stop(block=True, timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.metrics.close()

    # ---- requests ----
    def submit(self, request: InferenceRequest, sender: ResponseSender) -> None:
        """Parse a request and run it on the engine loop; errors go back as the request's final response."""
        try:
            req = vllm_request.parse(request)
        except NaiadError as exc:
            sender.send(error=exc, final=True)
            return
        if req.images and self.images is None:
            sender.send(
                error=InvalidArgument(
                    f"model '{self.name}' is not multimodal: it takes no images (a vision-language model's folder "
                    "has a vision_config and a processor)"
                ),
                final=True,
            )
            return
        if req.embedding is not None:
            work = self._embed(req, sender)
        elif req.images and self.images is not None:
            work = self.images.generate(req, sender)
        else:
            work = self._generate(req, sender)
        asyncio.run_coroutine_threadsafe(work, self.loop)

    def _encode(self, text: str) -> list[int]:
        limits.check_prompt(text, self.prompt_byte_limit, self.context_length)  # before the tokenizer sees it
        return list(self.tokenizer(text)["input_ids"])

    async def _embed(self, req: vllm_request.VllmRequest, sender: ResponseSender) -> None:
        try:
            source = req.embedding["input"] if req.embedding else ""
            if isinstance(source, str):
                ids = self._encode(source)
            elif isinstance(source, list) and source and all(isinstance(i, int) for i in source):
                ids = list(source)
            else:
                raise InvalidArgument("embedding_request 'input' must be a string or a list of token ids")
            if not ids:
                raise InvalidArgument("embedding_request 'input' is empty")
            if self.context_length and len(ids) > self.context_length:
                raise InvalidArgument(
                    f"the input has {len(ids)} tokens, more than the context length {self.context_length}"
                )
            vector = await asyncio.get_running_loop().run_in_executor(None, self._mean_hidden, ids)
            dims = (req.embedding or {}).get("pooling_params", {}).get("dimensions")
            if dims:
                vector = vector[: int(dims[0] if isinstance(dims, list) else dims)]
            out = vllm_request.outputs(req, json.dumps(vector), num_input_tokens=len(ids))
            sender.send(out, final=True)
        except Exception as exc:
            sender.send(error=exc, final=True)

    def _mean_hidden(self, ids: list[int]) -> list[float]:
        with self.torch.inference_mode():
            hidden = self.model.model(
                input_ids=self.torch.tensor([ids], device=self.device)
            ).last_hidden_state
            return hidden[0].float().mean(dim=0).cpu().tolist()

    def _sampling(self, sampling: dict[str, Any], prompt_len: int) -> tuple[int, dict[str, Any]]:
        if int(vllm_request.number(sampling, "n", int, 1)) != 1:
            raise InvalidArgument("the transformers backend generates one sequence per request (n must be 1)")
        max_tokens = vllm_request.number(sampling, "max_tokens", int, 16)
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, got {max_tokens}")
        if self.context_length and prompt_len + max_tokens > self.context_length:
            raise InvalidArgument(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is longer than the context "
                f"length {self.context_length}"
            )
        temperature = vllm_request.number(sampling, "temperature", float, 1.0)
        top_p = vllm_request.number(sampling, "top_p", float, 1.0)
        top_k = vllm_request.number(sampling, "top_k", int, 0)
        if temperature < 0 or not 0 < top_p <= 1:
            raise InvalidArgument("temperature must be >= 0 and top_p in (0, 1]")
        if temperature == 0:  # greedy: the top token only
            return max_tokens, {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        top_k = self.vocab_size if top_k <= 0 else min(top_k, self.vocab_size)
        return max_tokens, {"temperature": temperature, "top_k": top_k, "top_p": top_p}

    async def _generate(self, req: vllm_request.VllmRequest, sender: ResponseSender) -> None:
        metrics = self.metrics.arrived()
        rid = f"naiad-{next(self._ids)}"
        prompt_ids: list[int] = []
        generated = 0
        finish = "abort"
        try:
            prompt_ids = self._encode(req.prompt)
            if not prompt_ids:
                raise InvalidArgument("the prompt is empty")
            max_tokens, processors = self._sampling(req.sampling, len(prompt_ids))
            stops = vllm_request.stop_strings(req.sampling)
            seed = req.sampling.get("seed")
            if seed is not None:
                if isinstance(seed, bool) or not isinstance(seed, int):
                    raise InvalidArgument(f"sampling parameter 'seed' must be an integer, got {seed!r}")
                self.seeds.register(rid, seed)
            ignore_eos = bool(req.sampling.get("ignore_eos", False))
            structured = req.sampling.get("structured_outputs")
            if structured not in (None, "", b""):
                if ignore_eos or vllm_request.number(req.sampling, "min_tokens", int, 0) > 0:
                    raise InvalidArgument(
                        "'structured_outputs' cannot be combined with 'ignore_eos' or 'min_tokens'"
                    )
                compiled = await self.loop.run_in_executor(None, self.grammars.compile, structured)
                if compiled is not None:
                    self.grammars.register(rid, compiled)
            results: asyncio.Queue = asyncio.Queue()
            self.manager.register_result_handler(rid, results.put_nowait)
            added = self.manager.add_request(
                prompt_ids,
                request_id=rid,
                max_new_tokens=max_tokens,
                streaming=True,
                eos_token_id=-1 if ignore_eos else (self.eos_ids[0] if self.eos_ids else -1),
                **processors,
            )
            if added is None:
                raise Unavailable(f"model '{self.name}': the continuous-batching manager refused the request")
            text, sent, tokens, counted = "", 0, [], 0
            while True:
                try:
                    result = await asyncio.wait_for(results.get(), timeout=0.25)
                except TimeoutError:
                    result = None
                if sender.is_cancelled():
                    self.manager.cancel_request(rid)
                    return
                if result is None:
                    continue
                if result.error:
                    raise Unavailable(f"model '{self.name}': generation failed: {result.error}")
                metrics.scheduled()
                new = list(result.generated_tokens)[len(tokens) :]
                tokens.extend(new)
                metrics.tokens(len(new))
                done = result.is_finished()
                visible = [t for t in tokens if t not in self.eos_ids]
                text = self.tokenizer.decode(visible, skip_special_tokens=True)
                stopped = False
                for stop in stops:
                    at = text.find(stop)
                    if at >= 0:
                        text, stopped = text[:at], True
                if stopped:
                    self.manager.cancel_request(rid)
                    finish, done = "stop", True
                elif done:
                    finish = "stop" if tokens and tokens[-1] in self.eos_ids and not ignore_eos else "length"
                generated = len(tokens)
                # hold back what could be the start of a stop string or a partial UTF-8 character
                end = len(text) if done else _safe_end(text, stops)
                if req.stream and (end > sent or done):
                    out = vllm_request.outputs(
                        req,
                        text[sent:end],
                        finish_reason=finish if done else None,
                        num_input_tokens=len(prompt_ids),
                        num_output_tokens=len(tokens) - counted,  # held-back tokens count in this delta
                    )
                    sent, counted = end, len(tokens)
                    sender.send(out, final=done)
                if done:
                    break
            if not req.stream:
                full = (req.prompt if req.prepend_input else "") + text
                out = vllm_request.outputs(
                    req,
                    full,
                    finish_reason=finish,
                    num_input_tokens=len(prompt_ids),
                    num_output_tokens=generated,
                )
                sender.send(out, final=True)
        except Exception as exc:
            finish = "error"  # not an abort: the request failed (vLLM's FinishReason.ERROR)
            sender.send(error=exc, final=True)
        finally:
            self.seeds.forget(rid)
            self.grammars.forget(rid)
            metrics.finished(len(prompt_ids), generated, finish)
