"""Speculative decoding for the llama.cpp engine: a drafter proposes a few tokens per running sequence, the model
verifies them in the step's one `llama_decode`, and every token it would have produced itself is kept.

Two drafters, chosen by the model's parameters (params.MODEL_PARAMETERS):

- a **draft model** (`speculative_model`): a smaller GGUF sharing the model's vocabulary, in a llama context of its
  own with one KV sequence per slot (the same sequence ids). Before a step the engine's sequences that decode are
  brought up to date in it (the tokens the model took since the last step, or a whole prompt, one batched decode),
  then it drafts greedily, one batched decode per draft position for all drafting sequences together (as llama.cpp's
  own server drafts with `draft-simple`). Its vocabulary is checked at load as llama.cpp's
  `common_speculative_are_compatible` checks it: the same tokenizer type, BOS/EOS, sizes within 128 tokens, and the
  same text for every token id from 5 up to the smaller vocabulary; an incompatible draft fails the load.
- **prompt lookup** (`speculative_ngram`, vLLM's `ngram` method, llama.cpp's lookup): the last n tokens of the
  sequence (n from `speculative_ngram` down to `speculative_ngram_min`, the longest that matches) are looked up in
  its prompt and output, and the tokens that followed their latest earlier occurrence are proposed (a match close to
  the end continues into the proposal itself, so a loop of period p proposes the loop). No model, no decode.
  With both set, prompt lookup drafts first and the draft model drafts for the sequences it found nothing for.

Verification (`verify`): a sequence's batch entry is its last sampled token followed by its draft, every position
with logits. The request's own sampler chain (greedy, or temperature/top-k/top-p/min-p with its seed, the grammar of
structured output, the end-of-generation ban of `min_tokens`) samples position 0; while the token it picks is the
drafted one, the next position (whose logits already see that token) is sampled too, and so on: the tokens kept are
those the model would have produced one step at a time, plus its own token at the first disagreement (or after the
whole draft). Each kept token goes through the engine's per-token path (stop strings, max_tokens, end of generation,
logprobs, metrics), so the output is the same as without speculation: greedy exactly, and a seeded sampler too (its
random stream advances once per kept token, as it would). For a drafter that proposes one token (greedy drafting,
prompt lookup) this is the standard rejection sampling of speculative decoding, whose acceptance probability for a
draft token d is p(d); it needs no draft probabilities. The KV cells of the rejected positions are removed with
`llama_memory_seq_rm` from the model's context, and from the draft model's.

vLLM's `vllm:spec_decode_*` counters count drafts (sequences that verified a non-empty draft), draft tokens,
accepted tokens and accepted tokens per draft position.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ...errors import InvalidArgument
from ...llm.metrics import EngineMetrics
from .params import EngineSettings, context_params

log = logging.getLogger("naiad.llamacpp")

VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
VOCAB_CHECK_START_TOKEN_ID = (
    5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID: ids below may differ (special tokens)
)


def create(
    lc, settings: EngineSettings, model, memory, n_ctx: int, metrics: EngineMetrics
) -> Speculator | None:
    """The engine's speculator, or None when its parameters ask for no speculation."""
    if not settings.speculative_model and settings.speculative_ngram <= 0:
        return None
    if lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model):
        raise InvalidArgument(
            "speculative decoding needs a model whose KV cells can be removed from a position on (rejected draft "
            "tokens); recurrent and hybrid models (Mamba, RWKV, ...) cannot: remove the speculative_* parameters"
        )
    draft = DraftModel(lc, settings, model) if settings.speculative_model else None
    return Speculator(lc, settings, memory, n_ctx, metrics, draft)


@dataclass
class _Job:
    """One sequence the draft model drafts for this step."""

    seq: int
    committed: list[int]  # what the model has: its KV's tokens and the last sampled token
    limit: int  # most tokens to draft
    draft: list[int] = field(default_factory=list)


class DraftModel:
    """A draft GGUF and its context: one KV sequence per slot, `held[seq]` the tokens its cells hold."""

    def __init__(self, lc, settings: EngineSettings, target_model):
        self._lc = lc
        path = settings.speculative_model
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise InvalidArgument(f"llama.cpp could not load the draft model '{path}' (speculative_model)")
        try:
            why = incompatibility(lc, target_model, self.model)
            if why:
                raise InvalidArgument(
                    f"the draft model '{path}' (speculative_model) cannot draft for this model: {why}"
                )
            self.vocab = lc.llama_model_get_vocab(self.model)
            self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
            self.target_n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(target_model))
            cparams = context_params(lc, settings)
            self.ctx = lc.llama_init_from_model(self.model, cparams)
            if not self.ctx:
                raise InvalidArgument(f"llama.cpp could not create a context for the draft model '{path}'")
        except BaseException:
            lc.llama_model_free(self.model)
            raise
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_batch = settings.n_batch
        self.batch = lc.llama_batch_init(settings.n_batch, 0, 1)
        self.p_min = settings.speculative_p_min
        self.held: list[list[int]] = [[] for _ in range(settings.n_parallel)]
        self.decodes = 0  # llama_decode calls (tests, the benchmark)

    def close(self) -> None:
        lc = self._lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def trim(self, seq: int, tokens: list[int]) -> None:
        """Remove the cells past the longest prefix that `held[seq]` shares with `tokens` (what the model's KV holds
        now): the draft tokens the model rejected, or another request's tokens."""
        held = self.held[seq]
        n = len(held)
        if n <= len(tokens) and tokens[:n] == held:
            return
        keep = common_prefix(held, tokens)
        if not self._lc.llama_memory_seq_rm(self.memory, seq, keep, -1):
            keep = 0
            self._lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
        del held[keep:]

    def draft(self, jobs: list[_Job]) -> None:
        """Greedy drafts for `jobs` (each gets at most `limit` tokens in `draft`)."""
        jobs = jobs[: self.n_batch]
        # catch up: every committed token but the last (no logits), then the last ones together (logits)
        catch: list[tuple[int, int, int]] = []  # seq, position, token
        for job in jobs:
            self.trim(job.seq, job.committed[:-1])
            held = self.held[job.seq]
            catch.extend(
                (job.seq, pos, job.committed[pos]) for pos in range(len(held), len(job.committed) - 1)
            )
            held.extend(job.committed[len(held) : -1])
        while len(catch) + len(jobs) > self.n_batch:
            chunk, catch = catch[: self.n_batch], catch[self.n_batch :]
            self._decode([(s, p, t, False) for s, p, t in chunk])
        entries = [(s, p, t, False) for s, p, t in catch]
        for job in jobs:
            entries.append((job.seq, len(job.committed) - 1, job.committed[-1], True))
            self.held[job.seq].append(job.committed[-1])
        active = list(enumerate(jobs, start=len(catch)))  # (logits index, job)
        self._decode(entries)
        while active:
            entries, following = [], []
            for index, job in active:
                token = self._pick(index)
                if token < 0:
                    continue
                job.draft.append(token)
                if len(job.draft) >= job.limit:
                    continue
                following.append((len(entries), job))
                entries.append((job.seq, len(job.committed) - 1 + len(job.draft), token, True))
                self.held[job.seq].append(token)
            if not entries:
                break
            self._decode(entries)
            active = following

    def _pick(self, index: int) -> int:
        """The draft model's most likely token at batch position `index`; -1 when it is not sure enough
        (speculative_p_min) or the token is not in the model's vocabulary."""
        logits = np.ctypeslib.as_array(self._lc.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
        token = int(np.argmax(logits))
        if token >= self.target_n_vocab:
            return -1
        if self.p_min > 0.0:
            p = 1.0 / float(np.exp(logits.astype(np.float64) - float(logits[token])).sum())
            if p < self.p_min:
                return -1
        return token

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        for i, (seq, pos, token, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if logits else 0
        batch.n_tokens = len(entries)
        self.decodes += 1
        rc = self._lc.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode of the draft model returned {rc}")


def incompatibility(lc, target_model, draft_model) -> str:
    """Why the draft model's vocabulary cannot draft for the target's ('' when it can), as llama.cpp's
    common_speculative_are_compatible decides."""
    tgt, dft = lc.llama_model_get_vocab(target_model), lc.llama_model_get_vocab(draft_model)
    if lc.llama_vocab_type(tgt) != lc.llama_vocab_type(dft):
        return f"its tokenizer type is {lc.llama_vocab_type(dft)}, the model's {lc.llama_vocab_type(tgt)}"
    for which, add, token in (
        ("BOS", lc.llama_vocab_get_add_bos, lc.llama_vocab_bos),
        ("EOS", lc.llama_vocab_get_add_eos, lc.llama_vocab_eos),
    ):
        if add(tgt) != add(dft) or (add(tgt) and token(tgt) != token(dft)):
            return f"its {which} token differs (added: {add(dft)}, id {token(dft)}; the model's: {add(tgt)}, id {token(tgt)})"
    n_tgt, n_dft = lc.llama_vocab_n_tokens(tgt), lc.llama_vocab_n_tokens(dft)
    if abs(n_tgt - n_dft) > VOCAB_MAX_SIZE_DIFFERENCE:
        return f"its vocabulary has {n_dft} tokens, the model's {n_tgt} (at most {VOCAB_MAX_SIZE_DIFFERENCE} apart)"
    text = lc.llama_vocab_get_text
    for token in range(VOCAB_CHECK_START_TOKEN_ID, min(n_tgt, n_dft)):
        a, b = text(tgt, token), text(dft, token)
        if a != b:
            return f"token {token} is {b!r} in it, {a!r} in the model"
    return ""


def ngram_draft(tokens: list[int], n_max: int, n_min: int, limit: int) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens (the
    longest n in [n_min, n_max] that occurs), at most `limit` of them; [] when none occurs."""
    length = len(tokens)
    if length < n_min + 1 or limit <= 0:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    start = -1
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # windows starting at 0 .. length-1-n: each has at least one token after it, the suffix itself excluded
        windows = sliding_window_view(seq[: length - 1], n)
        hits = np.flatnonzero((windows == seq[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            break
    if start < 0:
        return []
    out: list[int] = []
    for j in range(limit):  # past the end the proposal continues from itself (a loop repeats)
        src = start + j
        out.append(tokens[src] if src < length else out[src - length])
    return out


class Speculator:
    """What the engine calls: `propose` before a step's decode, `verify` for each sequence after it."""

    def __init__(
        self,
        lc,
        settings: EngineSettings,
        memory,
        n_ctx: int,
        metrics: EngineMetrics,
        draft: DraftModel | None,
    ):
        self._lc = lc
        self.memory = memory
        self.n_ctx = n_ctx
        self.max = settings.speculative_max
        self.min = max(1, settings.speculative_min)
        self.ngram = settings.speculative_ngram
        self.ngram_min = settings.speculative_ngram_min or settings.speculative_ngram
        self.draft_model = draft
        self.metrics = metrics
        metrics.enable_spec_decode(self.max)
        # what verification found (vLLM's counters, kept here too for tests and the benchmark)
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos = [0] * self.max

    def close(self) -> None:
        if self.draft_model is not None:
            self.draft_model.close()
            self.draft_model = None

    def propose(self, work: list[tuple[Any, list[int], bool]], budget: int) -> int:
        """Draft for the decoding sequences of a step (`work`: slot, [its last sampled token], True): each draft
        goes to the end of the slot's token list and to `slot.draft`. Returns the tokens added (at most `budget`)."""
        used = 0
        jobs: list[tuple[_Job, Any, list[int]]] = []
        for slot, tokens, _ in work:
            slot.draft = []
            req = slot.request
            # the model's own token after the draft must still be wanted, the last drafted position must fit the
            # sequence's n_ctx cells, and the batch n_batch
            wanted = req.max_tokens - req.generated - 1
            limit = min(self.max, wanted, self.n_ctx - 1 - len(slot.tokens), budget - used)
            if limit < self.min or req.media is not None:
                continue  # a prompt with images holds their positions' negative ids, which no drafter can take
            if self.ngram:
                draft = ngram_draft(slot.tokens + tokens, self.ngram, self.ngram_min, limit)
                if len(draft) >= self.min:
                    slot.draft = draft
                    tokens.extend(draft)
                    used += len(draft)
                    continue
            if self.draft_model is not None:
                jobs.append((_Job(slot.seq, slot.tokens + tokens, limit), slot, tokens))
                used += limit  # reserved; what is not drafted is given back below
        if jobs:
            self.draft_model.draft([job for job, _, _ in jobs])  # type: ignore[union-attr]
            for job, slot, tokens in jobs:
                used -= job.limit
                if len(job.draft) >= self.min:
                    slot.draft = job.draft
                    tokens.extend(job.draft)
                    used += len(job.draft)
        return used

    def verify(self, slot, sample: Callable[[Any], int]) -> None:
        """After the decode: keep the drafted tokens the request's sampler agrees with, and its own next token.
        `sample(slot)` samples at `slot.batch_index` and runs the engine's per-token path (it releases the slot
        when the request finishes)."""
        draft, slot.draft = slot.draft, []
        tokens = slot.tokens  # ... its last sampled token, then the draft
        decoded = len(tokens)
        del tokens[decoded - len(draft) :]
        accepted = 0
        while True:
            token = sample(slot)
            if accepted == len(draft) or token != draft[accepted]:
                break
            accepted += 1  # the model agrees: the drafted token's cell stays and its logits come next
            if slot.request is None:
                break  # ... but the request ended with it (a stop string, end of generation)
            tokens.append(token)
            slot.batch_index += 1
        if len(tokens) < decoded:
            if not self._lc.llama_memory_seq_rm(self.memory, slot.seq, len(tokens), -1):
                raise RuntimeError(f"llama.cpp could not remove rejected draft tokens of sequence {slot.seq}")
        if self.draft_model is not None:
            self.draft_model.trim(slot.seq, tokens)
        self.drafts += 1
        self.draft_tokens += len(draft)
        self.accepted += accepted
        per_pos = [1] * accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        self.metrics.spec_decode(1, len(draft), accepted, per_pos)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids `a` and `b` share (the engine's prefix reuse, a draft model's KV)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
