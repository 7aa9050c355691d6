"""Stand-in of vllm.v1.engine.async_llm.AsyncLLM: continuous batching of a word-echo "model".

Each engine step (NAIAD_VLLM_STANDIN_STEP_S seconds, 0.01 by default) admits waiting requests up to max_num_seqs
and gives every running request its next token: the prompt's words in reverse order, cycling. Stat loggers get
SchedulerStats and IterationStats after each step, as vLLM's v1 engine calls them. NAIAD_VLLM_STANDIN_HEALTHY_CHECKS=N
makes check_health() fail after N calls (vllm_backend's CI mock does the same with 1).
"""

import asyncio
import os
import sys
import time
from collections.abc import AsyncGenerator
from typing import Any

from vllm.config import VllmConfig
from vllm.engine.protocol import EngineClient
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class WordTokenizer:
    """Words are tokens; ids are handed out as words are first seen."""

    bos_token = "<s>"
    eos_token = "</s>"
    chat_template = CHAT_TEMPLATE

    def __init__(self) -> None:
        self._ids: dict[str, int] = {"<s>": 1, "</s>": 2}
        self._words: dict[int, str] = {1: "<s>", 2: "</s>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self._ids:
                self._ids[word] = len(self._ids) + 1
                self._words[self._ids[word]] = word
            ids.append(self._ids[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self._words.get(i, "?") for i in ids)


class _Request:
    def __init__(
        self,
        request_id: str,
        prompt: str,
        ids: list[int],
        params: Any,
        queue: asyncio.Queue,
        lora: Any = None,
    ):
        self.id = request_id
        self.prompt = prompt
        self.prompt_ids = ids
        self.params = params
        self.queue = queue
        self.words = list(reversed(prompt.split())) or ["end"]
        if lora is not None:  # what an adapter does to the stand-in: its name on every word
            self.words = [f"{lora.lora_name}:{w}" for w in self.words]
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.logprobs: list[dict[int, Logprob]] = []
        self.arrival = time.monotonic()
        self.last = 0.0


def _join_ray(parallel) -> None:
    """As vLLM's Ray executor starts (vllm.v1.executor.ray_utils.initialize_ray_cluster): join the Ray cluster
    (RAY_ADDRESS, else the local one) and refuse to start when it has fewer GPUs than the engine's world size."""
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="ERROR", log_to_driver=False)
    world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    gpus = int(ray.cluster_resources().get("GPU", 0))
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    if gpus < world:
        raise ValueError(
            f"The number of required GPUs exceeds the total number of available GPUs in the Ray cluster: "
            f"{world} > {gpus}"
        )
    print(f"vllm stand-in: ray executor over {nodes} nodes with {gpus} GPUs", file=sys.stderr, flush=True)


class AsyncLLM(EngineClient):
    def __init__(self, vllm_config: VllmConfig, stat_loggers: list | None = None, log_stats: bool = True):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.tokenizer = WordTokenizer()
        self._loggers = [factory(vllm_config, 0) for factory in (stat_loggers or [])] if log_stats else []
        self._waiting: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._step_task: asyncio.Task | None = None
        self._step_s = float(os.environ.get("NAIAD_VLLM_STANDIN_STEP_S", "0.01"))
        self._healthy_checks = int(os.environ.get("NAIAD_VLLM_STANDIN_HEALTHY_CHECKS", "-1"))
        self._checks = 0
        self.dead = False
        for logger in self._loggers:
            logger.log_engine_initialized()
        parallel = vllm_config.parallel_config
        print(
            f"vllm stand-in: engine for {self.model_config.model} with tensor_parallel_size="
            f"{parallel.tensor_parallel_size} pipeline_parallel_size={parallel.pipeline_parallel_size}",
            file=sys.stderr,
            flush=True,
        )
        if parallel.distributed_executor_backend == "ray":
            _join_ray(parallel)

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: VllmConfig,
        usage_context: Any = None,
        stat_loggers: list | None = None,
        enable_log_requests: bool = False,
        aggregate_engine_logging: bool = False,
        disable_log_stats: bool = False,
        **kwargs: Any,
    ) -> "AsyncLLM":
        return cls(vllm_config, stat_loggers, not disable_log_stats)

    @property
    def errored(self) -> bool:
        return self.dead

    async def reset_mm_cache(self) -> None:
        return None

    async def get_tokenizer(self, lora_request: Any = None) -> WordTokenizer:
        return self.tokenizer

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("embed",) if self.model_config.runner_type == "pooling" else ("generate",)

    async def check_health(self) -> None:
        self._checks += 1
        if self._healthy_checks >= 0 and self._checks > self._healthy_checks:
            self.dead = True
            raise RuntimeError("Simulated vLLM check_health() failure")

    async def abort(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            req = self._running.pop(rid, None)
            if req is None:
                req = next((r for r in self._waiting if r.id == rid), None)
                if req is not None:
                    self._waiting.remove(req)
            if req is not None:
                print(f"vllm stand-in: aborted request {rid}", file=sys.stderr, flush=True)
                req.queue.put_nowait(None)

    def shutdown(self) -> None:
        if self._step_task is not None:
            self._step_task.cancel()

    def _prompt(self, prompt: Any) -> tuple[str, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
                return self.tokenizer.decode(ids), ids
            prompt = prompt.get("prompt", "")
        return prompt, self.tokenizer.encode(prompt)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: Any = None,
        **kwargs: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        if self.dead:
            raise RuntimeError("the engine is dead")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError("generate() needs SamplingParams")
        if lora_request is not None and self.vllm_config.lora_config is None:
            raise ValueError(
                f"Got lora_request {lora_request} but LoRA is not enabled!"
            )  # as vLLM's v1 engine
        text, ids = self._prompt(prompt)
        queue: asyncio.Queue = asyncio.Queue()
        self._waiting.append(_Request(request_id, text, ids, sampling_params, queue, lora_request))
        self._ensure_stepping()
        try:
            while True:
                out = await queue.get()
                if out is None:
                    return
                yield out
                if out.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id)
            raise

    async def encode(
        self, prompt: Any, pooling_params: Any, request_id: str, lora_request: Any = None, **kwargs: Any
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        _, ids = self._prompt(prompt)
        dims = getattr(pooling_params, "dimensions", None) or 8
        vector = [((sum(ids) + 7 * i) % 13) / 13.0 for i in range(dims)]
        yield PoolingRequestOutput(request_id, PoolingOutput(vector), ids, True)

    def _ensure_stepping(self) -> None:
        if self._step_task is None or self._step_task.done():
            self._step_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._waiting or self._running:
            await asyncio.sleep(self._step_s)
            self._step()

    def _step(self) -> None:
        now = time.monotonic()
        stats = IterationStats()
        limit = self.vllm_config.scheduler_config.max_num_seqs
        while self._waiting and len(self._running) < limit:
            req = self._waiting.pop(0)
            self._running[req.id] = req
            stats.num_prompt_tokens += len(req.prompt_ids)
            stats.n_params_iter.append(req.params.n)
        for req in list(self._running.values()):
            params = req.params
            word = req.words[len(req.token_ids) % len(req.words)]
            token_id = self.tokenizer.encode(word)[0]
            req.token_ids.append(token_id)
            req.text += " " + word
            if params.logprobs is not None:
                req.logprobs.append({token_id: Logprob(-0.5, 1, " " + word)})
            stats.num_generation_tokens += 1
            if req.last:
                stats.inter_token_latencies_iter.append(now - req.last)
            else:
                stats.time_to_first_tokens_iter.append(now - req.arrival)
            req.last = now
            finish = None
            for stop in params.stop or []:
                at = req.text.find(stop)
                if at >= 0:
                    req.text = (
                        req.text[: at + len(stop)] if params.include_stop_str_in_output else req.text[:at]
                    )
                    finish = "stop"
                    break
            if finish is None and params.max_tokens is not None and len(req.token_ids) >= params.max_tokens:
                finish = "length"
            if finish is not None:
                del self._running[req.id]
                stats.finished_requests.append(
                    FinishedRequestStats(finish, now - req.arrival, len(req.prompt_ids), len(req.token_ids))
                )
            if params.output_kind == RequestOutputKind.FINAL_ONLY and finish is None:
                continue
            delta = params.output_kind == RequestOutputKind.DELTA
            text = req.text[req.sent :] if delta else req.text
            req.sent = len(req.text)
            completion = CompletionOutput(
                0,
                text,
                list(req.token_ids),
                -0.5 * len(req.logprobs) if params.logprobs is not None else None,
                list(req.logprobs) if params.logprobs is not None else None,
                finish,
            )
            req.queue.put_nowait(
                RequestOutput(req.id, req.prompt, req.prompt_ids, None, [completion], finish is not None)
            )
        scheduler = SchedulerStats(len(self._running), len(self._waiting), len(self._running) / max(1, limit))
        for logger in self._loggers:
            logger.record(scheduler, stats)
