"""A vllm_backend-style `model.py` in `--backend-directory` (Triton's python-based backend layout) on Naiad's
pb_utils, driving the stand-in `vllm` package (tests/standins: vLLM's API, not its behaviour; no GPU here).

The model below is written for this test in the style of Triton's vllm_backend `src/model.py` and makes the same
pb_utils calls: auto-complete of a bare config, `get_model_dir()`, a helper module beside model.py, the engine on
its own asyncio thread, responses sent from a response thread, `is_cancelled()` -> `abort()`, custom metrics
created from the engine's stat logger, a health check that unloads the model and answers UNAVAILABLE.
"""

from __future__ import annotations

import json
import queue
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from helpers import ROOT, NaiadProcess

STANDINS = ROOT / "tests" / "standins"

MODEL_PY = r"""
import asyncio
import json
import os
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils import random_uuid
from vllm.v1.engine.async_llm import AsyncLLM

from vllm_helpers.stats import StatLoggerFactory


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, config):
        have = {i["name"] for i in config.as_dict()["input"]}
        for name, dtype in (("text_input", "TYPE_STRING"), ("stream", "TYPE_BOOL"),
                            ("sampling_parameters", "TYPE_STRING"), ("exclude_input_in_output", "TYPE_BOOL")):
            if name not in have:
                spec = {"name": name, "data_type": dtype, "dims": [1]}
                if name != "text_input":
                    spec["optional"] = True
                config.add_input(spec)
        if not config.as_dict()["output"]:
            config.add_output({"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]})
        config.set_model_transaction_policy(dict(decoupled=True))
        config.set_max_batch_size(0)
        return config

    def initialize(self, args):
        self.args = args
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        assert pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        output = pb_utils.get_output_config_by_name(self.model_config, "text_output")
        self.output_dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        params = self.model_config["parameters"]
        self.health_check = params.get("ENABLE_VLLM_HEALTH_CHECK", {}).get("string_value") == "true"
        with open(os.path.join(pb_utils.get_model_dir(), "model.json")) as f:
            engine_json = json.load(f)
        if args["model_instance_kind"] not in ("CPU", "MODEL"):
            raise ValueError(f"unexpected instance kind {args['model_instance_kind']}")
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.stats = StatLoggerFactory(labels)
        engine_args = AsyncEngineArgs(**engine_json)
        started = threading.Event()

        async def run():
            self.loop = asyncio.get_running_loop()
            self.engine = AsyncLLM.from_vllm_config(engine_args.create_engine_config(), stat_loggers=[self.stats])
            self.shutdown = asyncio.Event()
            started.set()
            await self.shutdown.wait()
            self.engine.shutdown()

        self.event_thread = threading.Thread(target=asyncio.run, args=(run(),))
        self.event_thread.start()
        started.wait()
        self.responses = queue.Queue()
        self.response_thread = threading.Thread(target=self.response_loop)
        self.response_thread.start()
        self.healthy = True

    def response_loop(self):
        while True:
            item = self.responses.get()
            if item is None:
                return
            state, response, flags = item
            state["sender"].send(response, flags)
            if not flags:
                state["cancelled"] = state["sender"].is_cancelled()

    def execute(self, requests):
        if self.health_check:
            try:
                asyncio.run_coroutine_threadsafe(self.engine.check_health(), self.loop).result()
            except Exception as exc:
                self.logger.log_error(f"[vllm] engine is not healthy: {exc}")
                pb_utils.unload_model(self.model_config["name"])
                self.healthy = False
            if not self.healthy:
                for request in requests:
                    request.get_response_sender().send(
                        pb_utils.InferenceResponse(error=pb_utils.TritonError(
                            "Model is unavailable due to unhealthy vLLM engine", pb_utils.TritonError.UNAVAILABLE)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return None
        for request in requests:
            asyncio.run_coroutine_threadsafe(self.infer(request), self.loop)
        return None

    def tensor(self, request, name, default):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return default if t is None else t.as_numpy()[0]

    async def infer(self, request):
        sender = request.get_response_sender()
        state = {"sender": sender, "cancelled": False}
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            prompt = self.tensor(request, "text_input", b"").decode()
            stream = bool(self.tensor(request, "stream", False))
            parameters = self.tensor(request, "sampling_parameters", None)
            parameters = parameters.decode() if parameters is not None else request.parameters()
            prepend = not bool(self.tensor(request, "exclude_input_in_output", stream))
            params = SamplingParams(**json.loads(parameters))
            rid = random_uuid()
            sent = 0
            last = None
            async for output in self.engine.generate(prompt, params, rid):
                cancelled = state["cancelled"] if stream else sender.is_cancelled()
                if cancelled:
                    await self.engine.abort(rid)
                    self.logger.log_info("[vllm] cancelled a request")
                    if stream:
                        self.responses.put((state, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                            "Request was cancelled", pb_utils.TritonError.CANCELLED)), final))
                    return
                last = output
                if stream:
                    text = output.outputs[0].text[sent:]
                    sent = len(output.outputs[0].text)
                    out = pb_utils.Tensor("text_output", np.asarray([text.encode()], dtype=self.output_dtype))
                    self.responses.put((state, pb_utils.InferenceResponse([out]), final if output.finished else 0))
            if not stream:
                text = (last.prompt if prepend else "") + last.outputs[0].text
                out = pb_utils.Tensor("text_output", np.asarray([text.encode()], dtype=self.output_dtype))
                sender.send(pb_utils.InferenceResponse([out]), flags=final)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"Error generating stream: {exc}")),
                        flags=final)

    def finalize(self):
        self.loop.call_soon_threadsafe(self.shutdown.set)
        self.event_thread.join()
        self.responses.put(None)
        self.response_thread.join()
        self.stats.finalize()
"""

STATS_PY = r'''
import queue
import threading

import triton_python_backend_utils as pb_utils
from vllm.v1.metrics.loggers import StatLoggerBase, build_1_2_5_buckets


class StatLogger(StatLoggerBase):
    """Engine stats to Triton custom metrics, through a thread of its own (as vllm_backend's utils/metrics.py)."""

    def __init__(self, labels, vllm_config, engine_index):
        super().__init__(vllm_config, engine_index)
        tokens = pb_utils.MetricFamily("vllm:generation_tokens_total", "Generation tokens.", pb_utils.MetricFamily.COUNTER)
        ttft = pb_utils.MetricFamily("vllm:time_to_first_token_seconds", "TTFT.", pb_utils.MetricFamily.HISTOGRAM)
        prompt = pb_utils.MetricFamily("vllm:request_prompt_tokens", "Prompt tokens.", pb_utils.MetricFamily.HISTOGRAM)
        self.tokens = tokens.Metric(labels=labels)
        self.ttft = ttft.Metric(labels=labels, buckets=[0.001, 0.01, 0.1, 1.0, 10.0])
        self.prompt = prompt.Metric(labels=labels, buckets=build_1_2_5_buckets(vllm_config.model_config.max_model_len))
        self.queue = queue.Queue()
        self.thread = threading.Thread(target=self.loop)
        self.thread.start()

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if iteration_stats.num_generation_tokens:
            self.queue.put((self.tokens.increment, iteration_stats.num_generation_tokens))
        for value in iteration_stats.time_to_first_tokens_iter:
            self.queue.put((self.ttft.observe, value))
        for finished in iteration_stats.finished_requests:
            self.queue.put((self.prompt.observe, finished.num_prompt_tokens))

    def loop(self):
        while (item := self.queue.get()) is not None:
            item[0](item[1])

    def finalize(self):
        self.queue.put(None)
        self.thread.join()


class StatLoggerFactory:
    def __init__(self, labels):
        self.labels = labels
        self.loggers = []

    def __call__(self, vllm_config, engine_index):
        self.loggers.append(StatLogger(self.labels, vllm_config, engine_index))
        return self.loggers[-1]

    def finalize(self):
        for logger in self.loggers:
            logger.finalize()
'''


def write_backend(folder: Path) -> None:
    (folder / "vllm" / "vllm_helpers").mkdir(parents=True)
    (folder / "vllm" / "model.py").write_text(MODEL_PY)
    (folder / "vllm" / "vllm_helpers" / "__init__.py").write_text("")
    (folder / "vllm" / "vllm_helpers" / "stats.py").write_text(STATS_PY)


def write_model(repo: Path, name: str, extra: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text('backend: "vllm"\n' + extra)
    (repo / name / "1" / "model.json").write_text(
        json.dumps({"model": "stand-in", "disable_log_stats": False})
    )
    # a Hugging Face tokenizer's config beside the model, as a vLLM model folder has: the OpenAI frontend's template
    (repo / name / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}", "eos_token": ""}
        )
    )


def standin_path(tmp: Path) -> str:
    """The stand-in vllm copied into a folder of its own: the server imports it from there."""
    site = tmp / "site"
    shutil.copytree(STANDINS / "vllm", site / "vllm")
    return str(ROOT / "server") + ":" + str(site)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_pb")
    write_backend(tmp / "backends")
    repo = tmp / "models"
    write_model(repo, "vllm_model", "instance_group [ { count: 1 kind: KIND_MODEL } ]\n")
    write_model(
        repo,
        "vllm_unhealthy",
        'parameters: { key: "ENABLE_VLLM_HEALTH_CHECK" value: { string_value: "true" } }\n',
    )
    with serve_backend(tmp, repo) as proc:
        yield proc


def serve_backend(tmp: Path, repo: Path) -> NaiadProcess:
    """`naiad serve` with `tmp/backends` as its backend directory and the stand-in vllm importable, every model of
    `repo` loaded."""
    env = {"PYTHONPATH": standin_path(tmp), "NAIAD_VLLM_STANDIN_HEALTHY_CHECKS": "1"}
    args = [
        "--backend-directory",
        str(tmp / "backends"),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
    ]
    return NaiadProcess(repo, *args, env=env, timeout=120)


def test_bare_config_is_auto_completed(server):
    config = requests.get(f"{server.url}/v2/models/vllm_model/config").json()
    inputs = {i["name"]: i for i in config["input"]}
    assert list(inputs) == ["text_input", "stream", "sampling_parameters", "exclude_input_in_output"]
    assert inputs["stream"]["optional"] and not inputs["text_input"].get("optional", False)
    assert config["model_transaction_policy"]["decoupled"] is True
    assert config["max_batch_size"] == 0


def test_generate_reads_model_json_and_request_parameters(server):
    # no sampling_parameters tensor: the request's parameters are the sampling parameters
    r = requests.post(
        f"{server.url}/v2/models/vllm_model/generate",
        json={"text_input": "one two three", "parameters": {"max_tokens": 4}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == "one two three three two one three"


def test_stream_deltas_from_the_response_thread(server):
    r = requests.post(
        f"{server.url}/v2/models/vllm_model/generate_stream",
        json={"text_input": "a b c", "stream": True, "sampling_parameters": json.dumps({"max_tokens": 5})},
        stream=True,
    )
    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert [e["text_output"] for e in events] == [" c", " b", " a", " c", " b"]


def test_bad_sampling_parameters_are_an_error_of_the_request(server):
    r = requests.post(
        f"{server.url}/v2/models/vllm_model/generate",
        json={"text_input": "x", "sampling_parameters": json.dumps({"no_such_parameter": 1})},
    )
    assert r.status_code == 500 and "no_such_parameter" in r.json()["error"]


def test_cancelling_a_grpc_stream_aborts_the_engine_request(server):
    cancel_a_long_stream(server)
    assert "[vllm] cancelled a request" in server.output()


def cancel_a_long_stream(server) -> None:
    """Start a long streamed generation over gRPC, cancel it after three responses, and wait for the stand-in
    engine to say the request was aborted."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tensors = []
    for name, dtype, value in (
        ("text_input", "BYTES", np.array([b"w " * 4], dtype=object)),
        ("stream", "BOOL", np.array([True])),
        (
            "sampling_parameters",
            "BYTES",
            np.array([json.dumps({"max_tokens": 100000}).encode()], dtype=object),
        ),
    ):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(value)
        tensors.append(t)
    client.async_stream_infer("vllm_model", tensors, request_id="long")
    for _ in range(3):
        result, error = results.get(timeout=20)
        assert error is None and result.as_numpy("text_output")[0] == b" w"
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 20
    while "vllm stand-in: aborted request" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "vllm stand-in: aborted request" in server.output()


def test_custom_metrics_from_the_engine_stat_logger(server):
    requests.post(
        f"{server.url}/v2/models/vllm_model/generate",
        json={"text_input": "p q", "parameters": {"max_tokens": 3}},
    ).raise_for_status()
    deadline = time.monotonic() + 10
    labels = '{model="vllm_model",version="1"}'
    while time.monotonic() < deadline:
        text = requests.get(f"http://{server.metrics}/metrics").text
        if f"vllm:request_prompt_tokens_count{labels}" in text:
            break
        time.sleep(0.1)
    assert f"vllm:generation_tokens_total{labels}" in text
    assert 'vllm:time_to_first_token_seconds_bucket{model="vllm_model",version="1",le="10"}' in text
    assert 'vllm:request_prompt_tokens_bucket{model="vllm_model",version="1",le="2"}' in text


def test_failed_health_check_unloads_the_model_and_answers_unavailable(server):
    url = f"{server.url}/v2/models/vllm_unhealthy/generate"
    body = {"text_input": "a", "parameters": {"max_tokens": 1}}
    assert requests.post(url, json=body, timeout=20).status_code == 200  # the first check passes
    r = requests.post(url, json=body, timeout=20)  # the second fails: unload from execute, UNAVAILABLE
    assert r.status_code == 503 and "unhealthy" in r.json()["error"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        index = requests.post(f"{server.url}/v2/repository/index").json()
        state = next(m for m in index if m["name"] == "vllm_unhealthy").get("state")
        if state == "UNAVAILABLE":
            break
        time.sleep(0.1)
    assert state == "UNAVAILABLE"
    assert requests.post(url, json=body, timeout=20).status_code == 404


def test_openai_chat_through_the_vllm_backend_model(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "one two three"}]
    whole = client.chat.completions.create(model="vllm_model", messages=messages, max_tokens=4)
    assert whole.choices[0].message.content
    streamed = client.chat.completions.create(
        model="vllm_model", messages=messages, max_tokens=4, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content
    client.close()
