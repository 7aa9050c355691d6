"""Vision-language models on the transformers backend: a folder whose `config.json` has a `vision_config` (LLaVA,
Qwen2-VL, Idefics3/SmolVLM, Gemma 3, ...) is loaded with `AutoProcessor` and `AutoModelForImageTextToText`.

transformers' continuous batching feeds a model token ids only (no `pixel_values`), so requests with images are run
by `model.generate` instead, one at a time on a thread of their own (`ImageGeneration`), while text-only requests to
the same model keep the batching path beside them. An image request's prompt holds the model's image token where
each image goes (the model's chat template writes it for `{"type": "image"}` parts, as vLLM's frontend has it);
the processor expands each into the image's tokens and computes `pixel_values`. Streaming, stop strings,
`max_tokens` (cut to what the context leaves: the frontend counts only the text), `temperature`/`top_p`/`top_k`,
`min_tokens`, `ignore_eos` and cancellation work as on the batching path; a `seed` seeds torch's global generator
for that generation (best effort: the batching thread samples from it too); structured output is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from pathlib import Path
from typing import Any

from ...errors import InvalidArgument
from ...llm import images, limits, vllm_request
from .text import safe_end


def is_vision_model(folder: Path) -> bool:
    """Whether the Hugging Face folder holds a vision-language model (its config has a vision_config)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def load(folder: Path, dtype: Any) -> tuple[Any, Any]:
    """The folder's processor and image-text-to-text model."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "image_processor", None) is None:
        raise InvalidArgument(f"{folder}: the processor has no tokenizer or no image processor")
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype)
    return processor, model


class ImageGeneration:
    """Requests with images, run by `model.generate` on one thread; `engine` is generation.Engine."""

    def __init__(self, engine: Any, processor: Any):
        self.engine = engine
        self.processor = processor
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="transformers-images"
        )
        self._closing = threading.Event()

    def close(self) -> None:
        self._closing.set()
        self.executor.shutdown(wait=True, cancel_futures=True)

    def _inputs(self, req: vllm_request.VllmRequest) -> Any:
        """The processor's tensors for the prompt and its images (decoded and checked here, off the event loop)."""
        engine = self.engine
        limits.check_prompt(req.prompt, engine.prompt_byte_limit, engine.context_length)
        token = getattr(self.processor, "image_token", None)
        if isinstance(token, str) and token and req.prompt.count(token) != len(req.images):
            raise InvalidArgument(
                f"the prompt has {req.prompt.count(token)} image tokens ('{token}') but the request has "
                f"{len(req.images)} images: put the model's image token where each image goes"
            )
        pictures = [images.decode(data, f"image {i + 1}") for i, data in enumerate(req.images)]
        try:
            inputs = self.processor(text=[req.prompt], images=pictures, return_tensors="pt")
        except (ValueError, TypeError) as exc:  # e.g. image tokens and images that do not match
            raise InvalidArgument(f"the model's processor refused the prompt and its images: {exc}") from None
        return inputs.to(engine.device)

    def _run(
        self, inputs: Any, settings: dict[str, Any], seed: int | None, on_tokens, stop: threading.Event
    ) -> None:
        """`model.generate` (this class's thread): new tokens go to `on_tokens` as they come, until `stop`."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        closing = self._closing

        class Streamer(BaseStreamer):
            prompt_seen = False

            def put(self, value: Any) -> None:
                if not self.prompt_seen:  # generate hands the prompt over first
                    self.prompt_seen = True
                    return
                on_tokens(value.reshape(-1).tolist())

            def end(self) -> None:
                pass

        class Stopped(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                done = stop.is_set() or closing.is_set()
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

        model = self.engine.model
        with torch.inference_mode(), torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            model.generate(
                **inputs, **settings, streamer=Streamer(), stopping_criteria=StoppingCriteriaList([Stopped()])
            )

    def settings(self, req: vllm_request.VllmRequest, prompt_len: int) -> tuple[int, dict[str, Any]]:
        """max_new_tokens and generate's sampling arguments for the request."""
        engine = self.engine
        sampling = dict(req.sampling)
        if sampling.get("structured_outputs") not in (None, "", b""):
            raise InvalidArgument(
                "structured output ('structured_outputs', response_format, a forced tool_choice) is not supported "
                "with images on the transformers backend"
            )
        wanted = vllm_request.number(sampling, "max_tokens", int, None)
        ctx = engine.context_length
        if ctx and wanted is not None and prompt_len < ctx:  # the frontend counted the text alone
            sampling["max_tokens"] = min(wanted, ctx - prompt_len)
        max_tokens, processors = engine._sampling(sampling, prompt_len)
        ignore_eos = bool(sampling.get("ignore_eos", False))
        min_tokens = max_tokens if ignore_eos else vllm_request.number(sampling, "min_tokens", int, 0)
        settings: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "min_new_tokens": min(min_tokens, max_tokens),
        }
        if processors["top_k"] == 1:
            settings["do_sample"] = False
        else:
            settings.update(do_sample=True, **processors)
        tok = engine.tokenizer
        settings["pad_token_id"] = tok.pad_token_id if tok.pad_token_id is not None else 0
        if engine.eos_ids:
            settings["eos_token_id"] = engine.eos_ids
        return max_tokens, settings

    async def generate(self, req: vllm_request.VllmRequest, sender: Any) -> None:
        """One request with images, answered as the batching path answers (generation.Engine._generate)."""
        engine = self.engine
        loop = asyncio.get_running_loop()
        metrics = engine.metrics.arrived()
        prompt_len = generated = 0
        finish = "abort"
        stop = threading.Event()
        try:
            inputs = await loop.run_in_executor(None, self._inputs, req)
            prompt_len = int(inputs["input_ids"].shape[1])
            _, settings = self.settings(req, prompt_len)
            seed = req.sampling.get("seed")
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
                raise InvalidArgument(f"sampling parameter 'seed' must be an integer, got {seed!r}")
            stops = vllm_request.stop_strings(req.sampling)
            queue: asyncio.Queue = asyncio.Queue()

            def on_tokens(tokens: list[int]) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, tokens)

            running = loop.run_in_executor(self.executor, self._run, inputs, settings, seed, on_tokens, stop)
            running.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
            text, sent, tokens, counted = "", 0, [], 0
            started = False
            done = False
            while not done:
                try:
                    new = await asyncio.wait_for(queue.get(), timeout=0.25)
                except TimeoutError:
                    if sender.is_cancelled():
                        stop.set()
                        await running
                        return
                    continue
                if sender.is_cancelled():
                    stop.set()
                    await running
                    return
                if new is None:  # generate returned (or raised)
                    running.result()
                    done = True
                else:
                    if not started:
                        metrics.scheduled()
                        started = True
                    tokens.extend(new)
                    metrics.tokens(len(new))
                visible = [t for t in tokens if t not in engine.eos_ids]
                text = engine.tokenizer.decode(visible, skip_special_tokens=True)
                for s in stops:
                    at = text.find(s)
                    if at >= 0:
                        text, done, finish = text[:at], True, "stop"
                        stop.set()
                if done and finish != "stop":
                    ended_on_eos = bool(tokens) and tokens[-1] in engine.eos_ids
                    finish = "stop" if ended_on_eos and not req.sampling.get("ignore_eos") else "length"
                generated = len(tokens)
                end = len(text) if done else safe_end(text, stops)
                if req.stream and (end > sent or done):
                    out = vllm_request.outputs(
                        req,
                        text[sent:end],
                        finish_reason=finish if done else None,
                        num_input_tokens=prompt_len,
                        num_output_tokens=len(tokens) - counted,
                    )
                    sent, counted = end, len(tokens)
                    sender.send(out, final=done)
            if stop.is_set():
                await running
            if not req.stream:
                full = (req.prompt if req.prepend_input else "") + text
                out = vllm_request.outputs(
                    req, full, finish_reason=finish, num_input_tokens=prompt_len, num_output_tokens=generated
                )
                sender.send(out, final=True)
        except Exception as exc:
            finish = "error"
            stop.set()
            sender.send(error=exc, final=True)
        finally:
            metrics.finished(prompt_len, generated, finish)
