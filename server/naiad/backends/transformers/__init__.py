"""The `transformers` backend: a Hugging Face model folder served with transformers' continuous batching.

The version folder holds what `save_pretrained` writes (`config.json`, weights, tokenizer files). Each instance loads
the model with torch on its device (KIND_CPU, or KIND_GPU's device) and starts transformers' own
`ContinuousBatchingManager` (`model.init_continuous_batching`): requests join and leave the running batch between
steps, every step is one forward over the tokens of all running sequences (paged KV cache). Requests and responses
are in the vLLM shape (`naiad.llm.shape`); a bare `backend: "transformers"` config is completed to it.

Per request: `max_tokens`, `temperature` (0: greedy), `top_p`, `top_k`, `stop` strings, `ignore_eos`, streaming
deltas, cancellation (the sequence leaves the batch at the next step), `seed` (transformers' manager samples with
one generator for all sequences; a seeded request's rows are sampled again with its own, seed.py),
`structured_outputs` (json, json_object, regex, choice, grammar; compiled by xgrammar, grammar.py).
A folder whose model is no causal language model (a sentence-transformers folder: `modules.json`, a pooling
config; or an encoder such as BERT) is an embedding model instead (embedding.py): `embedding_request` is answered
with the folder's pooling (mean, CLS, max or last token) and normalisation, as sentence-transformers computes it;
a causal model's embeddings are the mean of its last hidden state over the prompt's tokens. The vLLM-named metrics
(naiad.llm.metrics) include `vllm:kv_cache_usage_perc`, sampled from the paged cache (kv_cache.py).

A folder whose `config.json` has a `vision_config` is a vision-language model (vision.py): loaded with its processor
(`AutoProcessor`, `AutoModelForImageTextToText`), its requests with images (the `image` input) run by `model.generate`
on a thread of their own, its text-only requests batched as any model's.

Config parameters (`parameters { key: ... value: { string_value: ... } }`): `max_num_seqs` (sequences in one
batch, 16), `num_blocks` and `block_size` (the paged KV cache: blocks of tokens, 256 of 32 by default; sized
explicitly because transformers' automatic sizing probes memory for half a minute on CPU), `max_batch_tokens`
(tokens in one forward, 512), `dtype` (`float32`, `bfloat16`, `float16`; default float32 on CPU, the model's on GPU).
"""

from __future__ import annotations

import threading
from typing import Any

from ..api import InstanceState
from ..engine_backend import EngineBackend
from .embedding import EmbeddingEngine, is_embedding_model

# transformers imports its classes lazily, and two threads importing the same one at once can see it half made
# (`cannot import name 'AutoModelForCausalLM'`): models load one at a time
_load_lock = threading.Lock()


def _engine(instance: InstanceState) -> Any:
    """The engine for the model folder: an embedding model's, or a (vision-)language model's."""
    with _load_lock:
        if is_embedding_model(instance.model.version_path):
            return EmbeddingEngine(instance)
        from .generation import Engine

        return Engine(instance)


class TransformersBackend(EngineBackend):
    """`backend: "transformers"`: see the module docstring."""

    name = "transformers"
    engine_class = staticmethod(_engine)


backend = TransformersBackend()
