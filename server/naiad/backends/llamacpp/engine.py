"""The llama.cpp engine: continuous batching of many sequences through llama-cpp-python's low-level API.

One engine thread owns a llama context with `n_parallel` KV-cache sequences (slots). Each step it admits queued
requests into free slots (the slot whose cached tokens share the longest prefix with the prompt, keeping that
prefix in the KV cache), drops cancelled requests, and builds one `llama_batch` holding every running sequence's
next token plus as much pending prompt as fits in `n_batch`; one `llama_decode` advances them all, then each
sequence samples with its own sampler chain (a GBNF grammar for structured output, temperature, top-k, top-p,
min-p, seed; greedy at temperature 0).
Requests join and leave between steps. The engine knows nothing of Triton: a request carries callbacks, so the
same engine serves the backend and the in-process benchmark.

LoRA adapters (`load_adapter`, `unload_adapter`) are loaded into the engine's model with `llama_adapter_lora_init`.
llama.cpp applies adapters to a whole context, not to a sequence, so a step groups its running sequences by the
adapter each asked for (the base model being one group) and decodes each group with `llama_decode` of its own after
`llama_set_adapters_lora`: sequences of different adapters and of the base all advance in every step, one decode per
adapter group. A slot's cached tokens are keyed by the adapter they were computed under, so prefix reuse never
takes KV cells another adapter (or the base) computed.

Speculative decoding (speculative.py: a draft model or prompt lookup, from the model's parameters) hooks in at three
places: a step's decoding sequences get their drafts after their last sampled token, every drafted position gets
logits in the same `llama_decode`, and `verify` samples them in order instead of `_sample` once.

Images (multimodal.py): a request's prompt may hold images, evaluated into its sequence by llama.cpp's multimodal
library as they reach the head of its pending prompt, between the batched decodes of the text around them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InvalidArgument, NotFound, Unavailable
from ...llm import limits
from ...llm.metrics import EngineMetrics, RequestMetrics
from .params import EngineSettings, SamplingParams, context_params
from .rpc import rpc_devices
from .speculative import Speculator, common_prefix
from .speculative import create as create_speculator
from .text import TextStream

log = logging.getLogger("naiad.llamacpp")

_backend_lock = threading.Lock()
_backend_ready = False

RECENT_PROMPTS = 32  # prompts whose token ids the engine remembers (LlamaEngine.tokenize) ...
RECENT_PROMPT_CHARS = 16384  # ... of at most this many characters each (a few MiB at most)


def _llama():
    """The llama_cpp module, its backend initialised once per process."""
    global _backend_ready
    try:
        import llama_cpp
    except ImportError as exc:
        raise Unavailable(
            "the llamacpp backend needs llama-cpp-python: run `make llm-deps` (tools/llama_cpp/build.sh builds "
            f"and caches the wheel) ({exc})"
        ) from None
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _backend_ready = True
    return llama_cpp


_captured = threading.local()  # .lines: llama.cpp's errors on this thread while a call's reason is wanted


def _log_callback(level: int, text: bytes, _user) -> None:
    """llama.cpp's log: errors (4) go to Naiad's log, warnings (3) to its debug level, the chatter of a load nowhere."""
    lines = getattr(_captured, "lines", None)
    if lines is not None and level == 4:
        lines.append(text.decode("utf-8", "replace").strip())
    if level == 4:
        log.error("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())
    elif level == 3:
        log.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


try:  # the callback type lives in llama_cpp; the module keeps a reference so it is never collected
    import llama_cpp as _lc

    _quiet_log = _lc.llama_log_callback(_log_callback)
except ImportError:  # reported when an engine is created
    _quiet_log = None


class _HeldGil:
    """The short, hot calls of a step bound through `ctypes.PyDLL`, which keeps the GIL during the call.

    A CDLL call releases the GIL and takes it back afterwards; while the server's event loop is busy (streaming
    the previous step's tokens) taking it back can wait a whole switch interval (5 ms) each time. Sampling one
    token and copying one piece take microseconds, so they hold the GIL instead and a step hands it over once,
    around `llama_decode` (a CDLL call: other threads run while the model computes).
    """

    def __init__(self, lc):
        import sys

        lib = ctypes.PyDLL(sys.modules["llama_cpp.llama_cpp"]._lib._name)
        self.sample = lib.llama_sampler_sample
        self.sample.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
        self.sample.restype = ctypes.c_int32


@dataclass
class Output:
    """What one step produced for one request."""

    text: str  # the new, final text (streaming delta)
    tokens: int  # new tokens this step
    finish_reason: str | None = None  # "stop", "length" once finished
    logprobs: list[dict] | None = None  # per new token: {token_id: {"logprob", "rank", "decoded_token"}}


@dataclass(eq=False)
class Adapter:
    """A LoRA adapter loaded into an engine's model (`handle`: llama.cpp's `llama_adapter_lora *`). Compared by
    identity: an adapter unloaded and loaded again under its name is another one, whose KV cells are not these."""

    name: str
    path: str
    handle: object = None  # None once freed


# the adapters (and their scales) a sequence decodes under; (): the base model
AdapterKey = tuple[tuple[Adapter, float], ...]


@dataclass
class GenerationRequest:
    """A prompt (token ids) and how to generate; `emit` is called on the engine thread with each Output,
    `fail` with an exception; `cancelled()` is polled between steps."""

    prompt: list[int]
    sampling: SamplingParams
    emit: Callable[[Output], None]
    fail: Callable[[BaseException], None]
    cancelled: Callable[[], bool] = lambda: False
    metrics: RequestMetrics | None = None
    max_tokens: int = 16
    generated: int = 0
    adapters: AdapterKey = ()  # from sampling.lora_name / lora_scale, resolved by submit
    media: Any = None  # the prompt's images (multimodal.MediaPrompt): `prompt` holds their positions' ids


@dataclass
class _Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)  # what the KV cache holds for this sequence
    tokens_adapters: AdapterKey = ()  # the adapters `tokens` were decoded under (prefix reuse matches both)
    request: GenerationRequest | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet decoded
    sampler: object = None
    sampler_eos: object = None  # the chain with end-of-generation tokens banned (min_tokens, ignore_eos)
    grammar: object = None  # the structured-output grammar sampler, outside the chain (see _sample_grammar)
    text: TextStream | None = None
    batch_index: int = -1  # where this slot's logits are in the current batch (-1: none)
    last_token: int = -1
    draft: list[int] = field(default_factory=list)  # this step's speculative tokens after last_token


class LlamaEngine:
    """A GGUF model, one context with `n_parallel` sequences, and the thread that decodes them."""

    def __init__(
        self, model_path: str | Path, settings: EngineSettings, metrics: EngineMetrics | None = None
    ):
        lc = self._lc = _llama()
        self.settings = settings
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        devices = None
        if settings.rpc_servers:
            # every layer goes to the RPC servers (split by their free memory); the NULL-terminated list keeps
            # the load to this model's servers, not every device the process registered
            found = rpc_devices(lc, settings.rpc_servers, settings.rpc_wait_seconds)
            devices = (ctypes.c_void_p * (len(found) + 1))(*found, None)
            mparams.devices = ctypes.cast(devices, ctypes.c_void_p)
            mparams.n_gpu_layers = 999
        self.model = lc.llama_model_load_from_file(str(model_path).encode(), mparams)
        del devices
        if not self.model:
            raise InvalidArgument(f"llama.cpp could not load '{model_path}' (not a GGUF model it supports)")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = lc.llama_model_n_ctx_train(self.model)
        self.n_ctx = settings.n_ctx
        # a prompt of more bytes than this cannot fit n_ctx tokens, however it is tokenized: refused untokenized
        # (llama.cpp's tokenizer is superlinear on some input: minutes for 500 KB). SPM and BPE vocabularies split
        # the text as it is; the others normalize it first (WordPiece strips accents, Unigram maps characters)
        self.prompt_byte_limit = limits.prompt_byte_limit(
            self.n_ctx,
            self._max_piece_bytes(),
            settings.max_prompt_bytes or None,
            normalizing=lc.llama_vocab_type(self.vocab)
            not in (lc.LLAMA_VOCAB_TYPE_SPM, lc.LLAMA_VOCAB_TYPE_BPE),
        )
        cparams = context_params(lc, settings)
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise InvalidArgument(f"llama.cpp could not create a context of {cparams.n_ctx} tokens")
        self.memory = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(settings.n_batch, 0, 1)
        self._embed_ctx = None
        self._embed_lock = threading.Lock()
        # the last prompts' token ids (tokenize): the OpenAI frontend counts a prompt's tokens against the context,
        # then the backend tokenizes the same text again; llama.cpp's BPE took 0.1-0.2 ms for a 100-character
        # prompt on the bench machine, twice on the way to the first token
        self._recent: dict[tuple[str, bool, bool], list[int]] = {}
        self._recent_lock = threading.Lock()
        self.metrics = metrics or EngineMetrics(None, "")
        try:
            self.speculator: Speculator | None = create_speculator(
                lc, settings, self.model, self.memory, self.n_ctx, self.metrics
            )
        except BaseException:
            lc.llama_batch_free(self.batch)
            lc.llama_free(self.ctx)
            lc.llama_model_free(self.model)
            raise
        self.slots = [_Slot(seq=i) for i in range(settings.n_parallel)]
        self._queue: collections.deque[GenerationRequest] = collections.deque()
        self._cond = threading.Condition()
        self._emitted = False  # a step's tokens went out: yield to the event loop after it
        self._stop = False
        self._eog = [t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)]
        self._eog_set = frozenset(self._eog)  # no ctypes call per token: each one hands the GIL over and back
        self._pieces: dict[int, bytes] = {}
        self.prefix_hits = 0  # prompt tokens found in a slot's KV cache instead of decoded (prefix reuse)
        self._hot = _HeldGil(lc)
        # the candidate arrays of grammar sampling (engine thread only): one token, and the whole vocabulary
        self._one_data = (lc.llama_token_data * 1)()
        self._one = lc.llama_token_data_array(data=self._one_data, size=1, selected=-1, sorted=False)
        self._every_data = (lc.llama_token_data * self.n_vocab)()
        self._every = lc.llama_token_data_array(
            data=self._every_data, size=self.n_vocab, selected=-1, sorted=False
        )
        self._candidates = np.ctypeslib.as_array(self._every_data)
        self._vocab_ids = np.arange(self.n_vocab, dtype=np.int32)
        # LoRA adapters by name; unloaded ones wait in _retired until no request holds them; _controls run on the
        # engine thread between steps (an adapter load: llama.cpp's model must not change under a decode)
        self.adapters: dict[str, Adapter] = {}
        self._retired: list[Adapter] = []
        self._controls: list[tuple[Callable[[], None], concurrent.futures.Future]] = []
        self._ctx_adapters: AdapterKey = ()  # what llama_set_adapters_lora last set on the context
        # vllm:lora_requests_info's last running and waiting adapters (None: never set)
        self._lora_reported: tuple[list[str], list[str]] | None = None
        self.media: Any = None  # multimodal.Media: the mtmd context, once the backend loads a projector
        self._thread = threading.Thread(target=self._run, name="llamacpp-engine", daemon=True)
        self._thread.start()

    # ---- the model's text side ----
    def _max_piece_bytes(self) -> int:
        """The longest text of any token, control tokens' included (a prompt may spell them)."""
        buf = ctypes.create_string_buffer(256)
        longest = 0
        to_piece = self._lc.llama_token_to_piece
        for token in range(self.n_vocab):
            n = to_piece(self.vocab, token, buf, 256, 0, True)
            longest = max(longest, abs(n))  # negative: the size a larger buffer would need
        return longest

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """`text`'s token ids; PromptTooLong (untokenized) past `prompt_byte_limit`."""
        limits.check_prompt(text, self.prompt_byte_limit, self.n_ctx)
        key = (text, add_special, parse_special)
        with self._recent_lock:
            known = self._recent.get(key)
        if known is not None:
            return list(known)
        tokens = self._tokenize(text, add_special, parse_special)
        if len(text) <= RECENT_PROMPT_CHARS:
            with self._recent_lock:
                if len(self._recent) >= RECENT_PROMPTS:
                    del self._recent[next(iter(self._recent))]  # the oldest
                self._recent[key] = tokens
        return list(tokens)

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (self._lc.llama_token * n_max)()
        n = self._lc.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (self._lc.llama_token * n_max)()
            n = self._lc.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def detokenize(self, tokens: list[int]) -> str:
        """The text of token ids, as llama.cpp's own server's /detokenize gives it (control tokens' text left
        out); an id outside the vocabulary is InvalidArgument."""
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")
        lc = self._lc
        ids = (lc.llama_token * len(tokens))(*tokens)
        size = max(64, 8 * len(tokens))
        buf = ctypes.create_string_buffer(size)
        n = lc.llama_detokenize(self.vocab, ids, len(tokens), buf, size, False, False)
        if n < 0:
            size = -n
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_detokenize(self.vocab, ids, len(tokens), buf, size, False, False)
        return buf.raw[:n].decode("utf-8", "replace")

    def piece(self, token: int, special: bool = False) -> bytes:
        """A token's bytes (control tokens render empty unless `special`)."""
        if not special:
            cached = self._pieces.get(token)
            if cached is not None:
                return cached
        buf = ctypes.create_string_buffer(64)
        n = self._lc.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lc.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        out = buf.raw[:n]
        if not special:
            self._pieces[token] = out
        return out

    def chat_template(self) -> str | None:
        raw = self._lc.llama_model_chat_template(self.model, None)
        return raw.decode("utf-8", "replace") if raw else None

    def special_text(self, which: str) -> str:
        fn = {"bos": self._lc.llama_vocab_bos, "eos": self._lc.llama_vocab_eos}[which]
        token = fn(self.vocab)
        return self.piece(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    # ---- requests ----
    def submit(self, request: GenerationRequest) -> None:
        """Queue a request (validated here: a prompt that does not fit is InvalidArgument, raised at once)."""
        n_prompt = len(request.prompt)
        if n_prompt == 0:
            raise InvalidArgument("the prompt is empty: it has no tokens")
        if n_prompt >= self.n_ctx:
            raise InvalidArgument(
                f"the prompt has {n_prompt} tokens, which does not fit this model's context of {self.n_ctx} "
                "tokens (n_ctx) with room for one generated token"
            )
        wanted = request.sampling.max_tokens
        if wanted is not None and n_prompt + wanted > self.n_ctx:
            raise InvalidArgument(
                f"the prompt ({n_prompt} tokens) plus max_tokens ({wanted}) is more than this model's context "
                f"of {self.n_ctx} tokens (n_ctx)"
            )
        request.max_tokens = wanted if wanted is not None else min(16, self.n_ctx - n_prompt)
        if request.sampling.grammar is not None:
            self.check_grammar(request.sampling.grammar)
        with self._cond:
            if self._stop:
                raise Unavailable("the llama.cpp engine is shutting down")
            request.adapters = self._adapter_key(request.sampling)
            request.metrics = self.metrics.arrived()
            self._queue.append(request)
            self._cond.notify()

    def _adapter_key(self, sp: SamplingParams) -> AdapterKey:
        """The adapters a request decodes under (its `lora_name` at `lora_scale`; a scale of 0 is the base)."""
        if sp.lora_name is None:
            return ()
        adapter = self.adapters.get(sp.lora_name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidArgument(
                f"LoRA adapter '{sp.lora_name}' is not loaded for this model (loaded: {known})"
            )
        return ((adapter, sp.lora_scale),) if sp.lora_scale != 0.0 else ()

    # ---- LoRA adapters ----
    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load the LoRA adapter GGUF at `path` under `name` (blocks until the engine thread has loaded it, between
        two steps). InvalidArgument for a name taken or a file llama.cpp refuses (its reason in the message)."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        path = str(path)

        def load() -> None:
            if name in self.adapters:
                raise InvalidArgument(f"LoRA adapter '{name}' is already loaded")
            _captured.lines = []
            # the process's llama.cpp log is Naiad's again (llama-cpp-python's Llama, or a test's reference, may
            # have set its own since): the reason llama.cpp gives is what the 400 says
            self._lc.llama_log_set(_quiet_log, ctypes.c_void_p(0))
            try:
                with self._embed_lock:  # the embeddings context decodes on other threads over the same model
                    handle = self._lc.llama_adapter_lora_init(self.model, path.encode())
                reasons = _captured.lines
            finally:
                _captured.lines = None
            if not handle:
                why = "; ".join(r.split(": ", 1)[-1] for r in reasons if r) or "see the server log"
                raise InvalidArgument(f"llama.cpp could not load the LoRA adapter '{path}': {why}")
            with self._cond:
                self.adapters[name] = Adapter(name, path, handle)

        self._control(load, done)
        done.result()

    def unload_adapter(self, name: str) -> None:
        """Unload adapter `name`: new requests may no longer name it; those that hold it finish, and it is freed
        after them. NotFound for an adapter that is not loaded."""
        with self._cond:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                raise NotFound(f"LoRA adapter '{name}' is not loaded")
            self._retired.append(adapter)
            self._cond.notify()

    def _control(self, fn: Callable[[], None], done: concurrent.futures.Future) -> None:
        """Run `fn` on the engine thread between steps; its outcome goes to `done`."""
        with self._cond:
            if self._stop:
                raise Unavailable("the llama.cpp engine is shutting down")
            self._controls.append((fn, done))
            self._cond.notify()

    def _run_controls(self) -> None:
        with self._cond:
            controls, self._controls = self._controls, []
        for fn, done in controls:
            try:
                fn()
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

    def _reap_adapters(self) -> None:
        """Free the unloaded adapters no queued or running request holds any more (engine thread)."""
        if not self._retired:
            return
        with self._cond:
            held = {a for r in self._queue for a, _ in r.adapters}
        held.update(a for s in self.slots if s.request is not None for a, _ in s.request.adapters)
        for adapter in [a for a in self._retired if a not in held]:
            self._retired.remove(adapter)
            if any(a is adapter for a, _ in self._ctx_adapters):
                self._set_adapters(())
            with self._embed_lock:
                self._lc.llama_adapter_lora_free(adapter.handle)
            adapter.handle = None

    def _set_adapters(self, key: AdapterKey) -> None:
        """Apply `key`'s adapters to the context (llama.cpp then re-reserves its graph on the next decode)."""
        if key == self._ctx_adapters:
            return
        lc = self._lc
        if key:
            handles = (lc.llama_adapter_lora_p_ctypes * len(key))(*(a.handle for a, _ in key))
            scales = (ctypes.c_float * len(key))(*(scale for _, scale in key))
            lc.llama_set_adapters_lora(self.ctx, handles, len(key), scales)
        else:
            lc.llama_set_adapters_lora(self.ctx, None, 0, None)
        self._ctx_adapters = key

    def check_grammar(self, grammar: str) -> None:
        """InvalidArgument unless llama.cpp parses `grammar` (GBNF with a `root` rule) against this vocabulary."""
        sampler = self._grammar_sampler(grammar)
        self._lc.llama_sampler_free(sampler)

    def _grammar_sampler(self, grammar: str):
        sampler = self._lc.llama_sampler_init_grammar(self.vocab, grammar.encode("utf-8"), b"root")
        if not sampler:
            raise InvalidArgument(
                "'structured_outputs': llama.cpp could not parse the grammar (GBNF with a 'root' rule)"
            )
        return sampler

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()
        lc = self._lc
        for slot in self.slots:
            self._free_samplers(slot)
        if self.media is not None:
            self.media.close()
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        if self.speculator is not None:
            self.speculator.close()
        if self._embed_ctx is not None:
            lc.llama_free(self._embed_ctx)
        for adapter in [*self.adapters.values(), *self._retired]:
            if adapter.handle is not None:
                lc.llama_adapter_lora_free(adapter.handle)
                adapter.handle = None
        self.adapters.clear()
        self._retired.clear()
        lc.llama_model_free(self.model)

    # ---- embeddings ----
    def embed(self, text: str) -> list[float]:
        """Mean-pooled embedding of `text` from a second context with embeddings on (created on first use)."""
        lc = self._lc
        tokens = self.tokenize(text)
        if not tokens:
            raise InvalidArgument("the embedding input is empty: it has no tokens")
        if len(tokens) > self.n_ctx:
            raise InvalidArgument(
                f"the embedding input has {len(tokens)} tokens, more than this model's context of {self.n_ctx}"
            )
        with self._embed_lock:
            if self._embed_ctx is None:
                cparams = lc.llama_context_default_params()
                cparams.n_ctx = self.n_ctx
                cparams.n_batch = self.n_ctx
                cparams.n_ubatch = self.n_ctx
                cparams.n_seq_max = 1
                cparams.n_threads = self.settings.n_threads
                cparams.n_threads_batch = self.settings.n_threads
                cparams.embeddings = True
                cparams.pooling_type = lc.LLAMA_POOLING_TYPE_MEAN
                cparams.no_perf = True
                ctx = lc.llama_init_from_model(self.model, cparams)
                if not ctx:
                    raise InvalidArgument("llama.cpp could not create an embeddings context for this model")
                self._embed_ctx = ctx
            ctx = self._embed_ctx
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            batch = lc.llama_batch_init(len(tokens), 0, 1)
            try:
                for i, t in enumerate(tokens):
                    batch.token[i] = t
                    batch.pos[i] = i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = 1
                batch.n_tokens = len(tokens)
                if lc.llama_decode(ctx, batch) != 0:
                    raise InvalidArgument("llama.cpp failed to compute the embedding")
                ptr = lc.llama_get_embeddings_seq(ctx, 0)
                if not ptr:
                    raise InvalidArgument("this model gives no pooled embeddings")
                n_embd = lc.llama_model_n_embd(self.model)
                return np.ctypeslib.as_array(ptr, shape=(n_embd,)).astype(float).tolist()
            finally:
                lc.llama_batch_free(batch)

    # ---- the engine thread ----
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while (
                        not self._stop
                        and not self._queue
                        and not self._controls
                        and not self._retired
                        and not any(s.request for s in self.slots)
                    ):
                        self._cond.wait()
                    if self._stop:
                        break
                self._run_controls()
                self._step()
                self._reap_adapters()
                if self._emitted:
                    # the GIL and the CPU to the event loop that the step's tokens woke: on a busy or single core
                    # it would otherwise wait for the scheduler to preempt this thread (milliseconds)
                    self._emitted = False
                    os.sched_yield()
        except BaseException as exc:  # a broken engine fails everything it holds, never hangs a client
            log.exception("llama.cpp engine thread failed")
            with self._cond:
                self._stop = True  # later submits are refused instead of queued for a thread that is gone
            self._fail_all(exc)
        self._fail_all(Unavailable("the model was unloaded while the request was running"))

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
            controls, self._controls = self._controls, []
        for _, done in controls:
            done.set_exception(exc)
        for req in queued:
            self._finish_metrics(req, "abort")
            _safe(req.fail, exc)
        for slot in self.slots:
            if slot.request is not None:
                req = slot.request
                self._release(slot)
                self._finish_metrics(req, "abort")
                _safe(req.fail, exc)

    def _step(self) -> None:
        self._drop_cancelled()
        self._admit()
        if self.media is not None:
            self.media.evaluate()  # images at the head of a slot's pending prompt, into its sequence
        # what each running sequence puts in this step: decoding ones their next token first, then prompt chunks in
        # what is left of n_batch
        work: list[tuple[_Slot, list[int], bool]] = []  # slot, tokens, whether the last one needs logits
        budget = self.settings.n_batch
        for slot in self.slots:
            slot.batch_index = -1
            if slot.request is not None and not slot.pending and budget > 0:
                work.append((slot, [slot.last_token], True))
                budget -= 1
        if self.speculator is not None and work:
            budget -= self.speculator.propose(work, budget)
        for slot in self.slots:
            if slot.request is None or not slot.pending or budget <= 0:
                continue
            media = slot.request.media
            take = slot.pending[: budget if media is None else media.text_run(slot.pending, budget)]
            if not take:
                continue  # an image comes first: evaluated as the next step starts
            del slot.pending[: len(take)]
            work.append((slot, take, not slot.pending))
            budget -= len(take)
        if not work:
            self._report_kv_usage()  # (cancelled requests were released: the gauge falls with them)
            self._report_lora()
            return
        # one llama_decode per adapter group (llama.cpp sets adapters on the whole context), the group whose
        # adapters the context has now first: a step with two groups switches once, not twice
        groups: dict[AdapterKey, list[tuple[_Slot, list[int], bool]]] = {}
        for item in work:
            key = item[0].request.adapters  # type: ignore[union-attr]
            groups.setdefault(key, []).append(item)
        order = sorted(groups, key=lambda k: k != self._ctx_adapters)
        for key in order:
            self._decode(key, groups[key])
        self._report_kv_usage()
        self._report_lora()

    def _decode(self, key: AdapterKey, items: list[tuple[_Slot, list[int], bool]]) -> None:
        """One llama_decode of these sequences' tokens under adapters `key`, then each samples its next token."""
        batch = self.batch
        n = 0
        for slot, tokens, logits in items:
            last_at = len(tokens) - 1 - len(slot.draft)  # a draft's tokens follow, each with logits too
            for i, t in enumerate(tokens):
                last = logits and i >= last_at
                self._put(batch, n, t, len(slot.tokens), slot.seq, last)
                slot.tokens.append(t)
                if last and i == last_at:
                    slot.batch_index = n
                n += 1
        batch.n_tokens = n
        self._set_adapters(key)
        rc = self._lc.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        for slot, _, _ in items:
            if slot.request is not None and slot.batch_index >= 0:
                if slot.draft:
                    self.speculator.verify(slot, self._sample)  # type: ignore[union-attr]
                else:
                    self._sample(slot)

    def _report_kv_usage(self) -> None:
        """vllm:kv_cache_usage_perc as vLLM counts it: the cells running sequences hold. A free slot's cells, kept
        for prefix reuse, count as free (vLLM's cached blocks that no request holds are free blocks too): the next
        request that needs them takes them. Each slot owns n_ctx cells (kv_unified off), so this is exact for what
        the engine holds; what llama.cpp does not say (cells padded to its own granularity) is not counted."""
        used = sum(len(s.tokens) for s in self.slots if s.request is not None)
        self.metrics.set_kv_cache_usage(used / (self.n_ctx * len(self.slots)))

    def _report_lora(self) -> None:
        """vllm:lora_requests_info, once the engine has had adapters: the adapters of running and of waiting
        requests (set when they change); max_lora is n_parallel, the most adapters one step can run."""
        if self._lora_reported is None and not self.adapters:
            return
        running = sorted({a.name for s in self.slots if s.request is not None for a, _ in s.request.adapters})
        with self._cond:
            waiting = sorted({a.name for r in self._queue for a, _ in r.adapters})
        if self._lora_reported != (running, waiting):
            self._lora_reported = (running, waiting)
            self.metrics.set_lora(running, waiting, len(self.slots))

    @staticmethod
    def _put(batch, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if logits else 0

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [r for r in self._queue if _safe_bool(r.cancelled)]
            for r in gone:
                self._queue.remove(r)
        for r in gone:
            self._finish_metrics(r, "abort")
        for slot in self.slots:
            req = slot.request
            if req is not None and _safe_bool(req.cancelled):
                self._release(slot)
                self._finish_metrics(req, "abort")

    def _admit(self) -> None:
        while True:
            free = [s for s in self.slots if s.request is None]
            if not free:
                return
            with self._cond:
                if not self._queue:
                    return
                req = self._queue.popleft()
            slot = max(free, key=lambda s: self._reusable(s, req))
            try:
                self._start(slot, req)
            except BaseException as exc:
                self._release(slot)
                self._finish_metrics(req, "abort")
                _safe(req.fail, exc)

    @staticmethod
    def _reusable(slot: _Slot, req: GenerationRequest) -> int:
        """How many of the prompt's first tokens the slot's KV cache holds, computed under the request's adapters."""
        if slot.tokens_adapters != req.adapters:
            return 0
        return common_prefix(slot.tokens, req.prompt)

    def _start(self, slot: _Slot, req: GenerationRequest) -> None:
        lc = self._lc
        keep = min(self._reusable(slot, req), len(req.prompt) - 1)
        if req.media is not None:
            keep = req.media.boundary(keep)  # an image's cells are kept whole or not at all
        if keep < len(slot.tokens):
            if not lc.llama_memory_seq_rm(self.memory, slot.seq, keep, -1):
                keep = 0
                lc.llama_memory_seq_rm(self.memory, slot.seq, -1, -1)
            del slot.tokens[keep:]
        slot.pending = list(req.prompt[keep:])
        slot.tokens_adapters = req.adapters
        self.prefix_hits += keep
        slot.request = req
        slot.text = TextStream(req.sampling.stop)
        slot.sampler = self._sampler(req.sampling, ban_eog=req.sampling.ignore_eos)
        if req.sampling.grammar is not None:
            slot.grammar = self._grammar_sampler(req.sampling.grammar)
        if req.sampling.min_tokens > 0 and not req.sampling.ignore_eos:
            slot.sampler_eos = self._sampler(req.sampling, ban_eog=True)
        if req.metrics is not None:
            req.metrics.scheduled()

    def _sampler(self, sp: SamplingParams, ban_eog: bool):
        lc = self._lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if ban_eog and self._eog:
            biases = (lc.llama_logit_bias * len(self._eog))()
            for i, t in enumerate(self._eog):
                biases[i].token = t
                biases[i].bias = float("-inf")
            lc.llama_sampler_chain_add(
                chain, lc.llama_sampler_init_logit_bias(self.n_vocab, len(self._eog), biases)
            )
        if sp.temperature <= 0.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            return chain
        if sp.top_k > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(sp.top_k))
        if sp.top_p < 1.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(sp.top_p, 1))
        if sp.min_p > 0.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(sp.min_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(sp.temperature))
        seed = sp.seed if sp.seed is not None else lc.LLAMA_DEFAULT_SEED
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
        return chain

    def _sample(self, slot: _Slot) -> int:
        req = slot.request
        assert req is not None
        sampler = (
            slot.sampler_eos
            if slot.sampler_eos is not None and req.generated < req.sampling.min_tokens
            else slot.sampler
        )
        if slot.grammar is None:
            token = self._hot.sample(sampler, self.ctx, slot.batch_index)
        else:
            token = self._sample_grammar(slot, sampler)
        logprobs = (
            self._logprobs(slot.batch_index, token, req.sampling.logprobs)
            if req.sampling.logprobs is not None
            else None
        )
        req.generated += 1
        if req.metrics is not None:
            req.metrics.tokens(1)
        finish = None
        if token in self._eog_set and not req.sampling.ignore_eos:
            text = slot.text.finish()
            finish = "stop"
        else:
            slot.last_token = token
            text = slot.text.push(self.piece(token))
            if slot.text.stopped:
                finish = "stop"
            elif req.generated >= req.max_tokens or len(slot.tokens) + 1 >= self.n_ctx:
                text += slot.text.finish()
                finish = "length"
        if finish is not None:
            self._release(slot)
            self._finish_metrics(req, finish)
        self._emitted = True
        _safe(req.emit, Output(text, 1, finish, logprobs))
        return token

    def _sample_grammar(self, slot: _Slot, sampler) -> int:
        """A token the grammar allows, as llama.cpp's own server picks it: the chain samples freely and the grammar
        checks that one token; only when it refuses does the grammar filter the whole vocabulary (a walk of every
        token's text, milliseconds for a large vocabulary) and the chain sample again from what is left."""
        lc = self._lc
        token = lc.llama_sampler_sample(sampler, self.ctx, slot.batch_index)
        one = self._one
        one.data = (
            self._one_data
        )  # a sampler may point `data` elsewhere; each call starts from the engine's own
        one.data[0].id, one.data[0].logit, one.data[0].p = token, 0.0, 0.0
        one.size, one.selected, one.sorted = 1, -1, False
        lc.llama_sampler_apply(slot.grammar, ctypes.byref(one))
        if one.data[0].logit != float("-inf"):
            lc.llama_sampler_accept(slot.grammar, token)
            return token
        logits = np.ctypeslib.as_array(
            lc.llama_get_logits_ith(self.ctx, slot.batch_index), shape=(self.n_vocab,)
        )
        cands = self._candidates
        cands["id"] = self._vocab_ids
        cands["logit"] = logits
        cands["p"] = 0.0
        every = self._every
        every.data = self._every_data
        every.size, every.selected, every.sorted = self.n_vocab, -1, False
        lc.llama_sampler_apply(slot.grammar, ctypes.byref(every))
        lc.llama_sampler_apply(sampler, ctypes.byref(every))
        if every.selected < 0:
            raise RuntimeError("llama.cpp's sampler chain selected no token under the grammar")
        token = int(every.data[every.selected].id)
        lc.llama_sampler_accept(slot.grammar, token)
        return token

    def _logprobs(self, index: int, token: int, top: int) -> list[dict]:
        ptr = self._lc.llama_get_logits_ith(self.ctx, index)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)
        logits -= logits.max()
        lp = logits - np.log(np.exp(logits).sum())
        best: list[int] = []
        if top > 0:  # the top few by a partition and a sort of those, not a sort of the whole vocabulary
            part = np.argpartition(-lp, top - 1)[:top]
            best = [int(t) for t in part[np.argsort(-lp[part], kind="stable")]]
        entry = {}
        for t in [token, *[t for t in best if t != token]]:
            entry[str(t)] = {
                "logprob": float(lp[t]),
                "rank": int(np.count_nonzero(lp > lp[t]) + 1),
                "decoded_token": self.piece(t).decode("utf-8", "replace"),
            }
        return [entry]

    def _release(self, slot: _Slot) -> None:
        """The slot is free again; its tokens stay in the KV cache for the next request's prefix."""
        if slot.pending:  # part of the prompt was never decoded: it is not in the cache
            slot.pending = []
        slot.request = None
        self._free_samplers(slot)

    def _free_samplers(self, slot: _Slot) -> None:
        for s in (slot.sampler, slot.sampler_eos, slot.grammar):
            if s is not None:
                self._lc.llama_sampler_free(s)
        slot.sampler = slot.sampler_eos = slot.grammar = None

    @staticmethod
    def _finish_metrics(req: GenerationRequest, reason: str) -> None:
        if req.metrics is not None:
            req.metrics.finished(len(req.prompt), req.generated, reason)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return sum(1 for s in self.slots if s.request is not None)


def _safe(fn: Callable, arg) -> None:
    try:
        fn(arg)
    except Exception:
        log.exception("llama.cpp engine: a response callback failed")


def _safe_bool(fn: Callable[[], bool]) -> bool:
    try:
        return bool(fn())
    except Exception:
        return True
