"""Test models for the OpenAI API: deterministic "counting" language models in the vLLM shape (decoupled) and the
TensorRT-LLM shape (decoupled and not, batched), an embedding model, and a model that is no LLM.

The generators make tokens " tok0", " tok1", ... up to max_tokens (finish "length"), so every count is known. Words
in the prompt steer them: SHOWPROMPT answers the prompt itself, SHOWPARAMS the settings the model received, SLOW
sleeps between tokens (PACE a little), WIDE makes each token 4 kB, STOPAT:k finishes with "stop" after k tokens, FAIL:k sends an error after k tokens,
CANCELFILE:path writes the path when the request is cancelled, TOOLCALL:name answers a call of that tool, THINK
answers a `<think>` block first, HERMES a Hermes-style call of `get_weather` after some text.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system must come first') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] or '' }}\n{% endfor %}"
    "{% if tools %}<|tools|>{{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_COMMON = """
import json
import os
import re
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def words(prompt):
    steer = {}
    for key, value in re.findall(r"([A-Z]{4,})(?::(\\S+))?", prompt):
        steer[key] = value or True
    return steer


class Tokens:
    # the tokens of one answer, made as they are read (max_tokens may be huge)

    def __init__(self, n, pad):
        self.n, self.pad = n, pad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.n:
            raise IndexError(i)
        return " tok%d" % i + self.pad


def tokens(n, steer):
    stop_at = int(steer.get("STOPAT", n))
    pad = "x" * 4000 if "WIDE" in steer else ""
    return Tokens(min(n, stop_at), pad), ("stop" if stop_at < n else "length")


def cancelled(sender, steer):
    if sender.is_cancelled():
        if steer.get("CANCELFILE"):
            with open(steer["CANCELFILE"], "w") as f:
                f.write("cancelled")
        return True
    return False
"""

VLLM_MODEL = (
    _COMMON
    + """

class TritonPythonModel:
    def initialize(self, args):
        self.config = json.loads(args["model_config"])

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.generate, args=(request,)).start()
        return None

    def opt(self, request, name, default):
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return default
        v = t.as_numpy().reshape(-1)[0]
        return v.decode() if isinstance(v, bytes) else v

    def generate(self, request):
        sender = request.get_response_sender()
        embed = self.opt(request, "embedding_request", None)
        if embed is not None:
            doc = json.loads(embed)
            text = doc["input"] if isinstance(doc["input"], str) else " ".join(map(str, doc["input"]))
            dims = (doc.get("pooling_params", {}).get("dimensions") or [4])[0]
            vector = [float(len(text))] + [float(i) / 10 for i in range(1, dims)]
            out = [
                pb_utils.Tensor("text_output", np.array([json.dumps(vector).encode()], dtype=object)),
                pb_utils.Tensor("num_input_tokens", np.array([len(text.split())], dtype=np.uint32)),
            ]
            sender.send(pb_utils.InferenceResponse(out), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        prompt = self.opt(request, "text_input", "")
        stream = bool(self.opt(request, "stream", False))
        params = json.loads(self.opt(request, "sampling_parameters", "{}") or "{}")
        exclude = bool(self.opt(request, "exclude_input_in_output", False))
        want_logprobs = bool(self.opt(request, "return_logprobs", False))
        steer = words(prompt)
        if "SHOWPARAMS" in steer or "SHOWPROMPT" in steer:
            text = prompt if "SHOWPROMPT" in steer else json.dumps(
                {"sampling_parameters": params, "stream": stream, "exclude_input_in_output": exclude}
            )
            sender.send(self.response(text, "stop", len(prompt.split()), 1, None),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        toks, reason = tokens(int(params.get("max_tokens", 16)), steer)
        if "TOOLCALL" in steer:  # a tool call as JSON, in three pieces
            call = json.dumps({"name": steer["TOOLCALL"], "arguments": {"city": "Paris"}})
            toks, reason = [call[:5], call[5:20], call[20:]], "stop"
        if "THINK" in steer:  # a thinking model: its reasoning first, its tags cut across tokens
            toks = ["<th", "ink>Let me ", "count.</th", "ink>\\n\\n", *toks]
        if "HERMES" in steer:  # text, then a call in Hermes' tags
            call = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
            toks, reason = ["Checking.", " <tool_", "call>", call, "</tool_call>"], "stop"
        fail = int(steer["FAIL"]) if "FAIL" in steer else None
        n_in = len(prompt.split())
        prefix = "" if exclude else prompt
        if not stream:
            for _ in toks if "SLOW" in steer else ():
                time.sleep(0.05)
                if cancelled(sender, steer):
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    return
            lps = [self.logprob(i, t) for i, t in enumerate(toks)] if want_logprobs else None
            sender.send(self.response(prefix + "".join(toks), reason, n_in, len(toks), lps),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        for i, t in enumerate(toks):
            if cancelled(sender, steer):
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            if fail is not None and i == fail:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("generation failed on purpose")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            if "SLOW" in steer:
                time.sleep(0.05)
            elif "PACE" in steer:
                time.sleep(0.001)
            last = i == len(toks) - 1
            lps = [self.logprob(i, t)] if want_logprobs else None
            sender.send(self.response((prefix if i == 0 else "") + t, reason if last else None, n_in, 1, lps))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def logprob(i, token):
        return {str(i): {"logprob": -0.5, "rank": 1, "decoded_token": token},
                "999": {"logprob": -2.0, "rank": 2, "decoded_token": " alt"}}

    @staticmethod
    def response(text, reason, n_in, n_out, logprobs):
        out = [
            pb_utils.Tensor("text_output", np.array([text.encode()], dtype=object)),
            pb_utils.Tensor("num_input_tokens", np.array([n_in], dtype=np.uint32)),
            pb_utils.Tensor("num_output_tokens", np.array([n_out], dtype=np.uint32)),
        ]
        if reason is not None:
            out.append(pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=object)))
        if logprobs is not None:
            out.append(pb_utils.Tensor("logprobs", np.array([json.dumps(logprobs).encode()], dtype=object)))
        return pb_utils.InferenceResponse(out)
"""
)

TRTLLM_MODEL = (
    _COMMON
    + """

NAMES = ("max_tokens", "temperature", "top_p", "stop_words", "seed", "stream", "exclude_input_in_output")


class TritonPythonModel:
    def initialize(self, args):
        self.config = json.loads(args["model_config"])
        self.decoupled = self.config.get("model_transaction_policy", {}).get("decoupled", False)

    def settings(self, request):
        got = {}
        for name in NAMES:
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is not None:
                values = [v.decode() if isinstance(v, bytes) else v.item() for v in t.as_numpy().reshape(-1)]
                got[name] = values if name == "stop_words" else values[0]
                got[name + "_shape"] = list(t.as_numpy().shape)
        return got

    def execute(self, requests):
        responses = []
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
            got = self.settings(request)
            steer = words(prompt)
            toks, _ = tokens(int(got.get("max_tokens", 16)), steer)
            if "SHOWPARAMS" in steer:
                toks = [json.dumps(got)]
            if not self.decoupled:
                text = np.array([["".join(toks).encode()]], dtype=object)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
                continue
            sender = request.get_response_sender()
            if got.get("stream"):
                for t in toks:
                    if cancelled(sender, steer):
                        break
                    text = np.array([[t.encode()]], dtype=object)
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
            else:
                text = np.array([["".join(toks).encode()]], dtype=object)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None if self.decoupled else responses
"""
)

PLAIN_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
"""

VLLM_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true },
  { name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "return_finish_reason" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "return_logprobs" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "return_num_input_tokens" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "return_num_output_tokens" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "embedding_request" data_type: TYPE_STRING dims: [ 1 ] optional: true }
]
output [
  { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "finish_reason" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "logprobs" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "num_input_tokens" data_type: TYPE_UINT32 dims: [ 1 ] },
  { name: "num_output_tokens" data_type: TYPE_UINT32 dims: [ -1 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

# tensorrtllm_backend's ensemble: batched, a [1] tensor per setting, stop_words a list
TRTLLM_CONFIG = """
backend: "python"
max_batch_size: 8
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] optional: true },
  { name: "top_p" data_type: TYPE_FP32 dims: [ 1 ] optional: true },
  { name: "stop_words" data_type: TYPE_STRING dims: [ -1 ] optional: true },
  { name: "seed" data_type: TYPE_UINT64 dims: [ 1 ] optional: true },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

PLAIN_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _model(repo: Path, name: str, config: str, code: str, tokenizer: dict | None = None) -> None:
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(f'name: "{name}"\n' + textwrap.dedent(config))
    (folder / "1" / "model.py").write_text(code)
    if tokenizer is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))


def build(repo: Path) -> Path:
    """The repository: counting_vllm (chat template in tokenizer_config.json), counting_vllm_guided (the same,
    declaring guided decoding), counting_trtllm (not decoupled), counting_trtllm_stream (decoupled, no template),
    plain (no LLM), thinking_vllm (counting_vllm with the qwen3 reasoning parser and the hermes tool parser)."""
    repo.mkdir(parents=True, exist_ok=True)
    tokenizer = {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    _model(repo, "counting_vllm", VLLM_CONFIG, VLLM_MODEL, tokenizer)
    guided = VLLM_CONFIG + 'parameters { key: "structured_outputs" value: { string_value: "true" } }\n'
    _model(repo, "counting_vllm_guided", guided, VLLM_MODEL, tokenizer)
    _model(repo, "counting_trtllm", TRTLLM_CONFIG, TRTLLM_MODEL, tokenizer)
    _model(
        repo,
        "counting_trtllm_stream",
        TRTLLM_CONFIG.replace(
            "max_batch_size: 8", "max_batch_size: 8\nmodel_transaction_policy { decoupled: true }"
        ),
        TRTLLM_MODEL,
    )
    _model(repo, "plain", PLAIN_CONFIG, PLAIN_MODEL)
    parsers = (
        'parameters { key: "reasoning_parser" value: { string_value: "qwen3" } }\n'
        'parameters { key: "tool_call_parser" value: { string_value: "hermes" } }\n'
    )
    _model(repo, "thinking_vllm", VLLM_CONFIG + parsers, VLLM_MODEL, tokenizer)
    return repo
