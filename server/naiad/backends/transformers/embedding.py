"""The transformers backend's embedding engine: an encoder (a sentence-transformers folder such as
all-MiniLM-L6-v2, or a bare BERT-like model) answering `embedding_request` with the folder's own pooling and
normalisation, as sentence-transformers computes them; the requests that wait are run as one padded batch.

A sentence-transformers folder says how in `modules.json`: a Transformer module (the folder itself), a Pooling module
(`1_Pooling/config.json`: mean, CLS, max, mean-sqrt-len or last token) and an optional Normalize; its
`sentence_bert_config.json` gives `max_seq_length`, the longest input (a longer one is refused, as vLLM refuses a
prompt past `max_model_len`). An encoder folder without them is pooled as vLLM pools one by default: the CLS
token, normalised. `dimensions` (Matryoshka truncation) is taken only from a model that says it was trained for it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import InvalidArgument, NaiadError, Unavailable
from ...inference import InferenceRequest
from ...llm import info as llm_info
from ...llm import limits, vllm_request
from ..api import InstanceState, ResponseSender

log = logging.getLogger("naiad.transformers")

MAX_BATCH = 32  # requests embedded in one forward
GENERATIVE = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
ST_MODULE = "sentence_transformers.models."


def is_embedding_model(folder: Path) -> bool:
    """Whether a model folder holds an embedding model: a sentence-transformers folder, or a model whose
    architectures are none of the generative ones."""
    if (folder / "modules.json").is_file():
        return True
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    architectures = config.get("architectures") or []
    return bool(architectures) and not any(a.endswith(GENERATIVE) for a in architectures)


@dataclass
class Pooling:
    """How token embeddings become one vector (sentence-transformers' Pooling module) and whether it is normalised."""

    mode: str = "cls"  # mean, cls, max, mean_sqrt_len, lasttoken
    normalize: bool = True
    max_seq_length: int | None = None
    matryoshka: bool = False


_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}


def read_pooling(folder: Path, config: dict[str, Any]) -> Pooling:
    """The folder's pooling: from its sentence-transformers modules, or vLLM's default for an encoder."""
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return Pooling(max_seq_length=config.get("max_position_embeddings"), matryoshka=matryoshka)
    try:
        modules = json.loads(modules_file.read_text())
    except ValueError as exc:
        raise InvalidArgument(f"{modules_file} is not valid JSON: {exc}") from None
    pooling = Pooling(mode="mean", normalize=False, matryoshka=matryoshka)
    for module in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(module.get("type", "")).removeprefix(ST_MODULE)
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            pooling.normalize = True
        elif kind == "Pooling":
            settings = json.loads((folder / module.get("path", "") / "config.json").read_text())
            modes = [mode for key, mode in _MODES.items() if settings.get(key)]
            if len(modes) != 1:
                raise InvalidArgument(
                    f"{folder}: the pooling module asks for {modes or 'no mode'}: one of "
                    f"{', '.join(_MODES.values())} is supported"
                )
            pooling.mode = modes[0]
        else:
            raise InvalidArgument(
                f"{folder}: the sentence-transformers module '{module.get('type')}' is not supported (Transformer, "
                "Pooling and Normalize are)"
            )
    st_config = folder / "sentence_bert_config.json"
    if st_config.is_file():
        pooling.max_seq_length = json.loads(st_config.read_text()).get("max_seq_length")
    st_model = folder / "config_sentence_transformers.json"
    if st_model.is_file() and json.loads(st_model.read_text()).get("matryoshka_dimensions"):
        pooling.matryoshka = True
    pooling.max_seq_length = pooling.max_seq_length or config.get("max_position_embeddings")
    return pooling


@dataclass
class _Job:
    req: vllm_request.VllmRequest
    ids: list[int]
    sender: ResponseSender


class EmbeddingEngine:
    """One instance: the encoder, its tokenizer and pooling, and a thread that embeds what waits, batched."""

    def __init__(self, instance: InstanceState):
        import torch
        from transformers import AutoModel, AutoTokenizer

        model = instance.model
        folder = model.version_path
        self.name = model.name
        self.torch = torch
        self.device = f"cuda:{instance.device_id}" if instance.kind == "GPU" else "cpu"
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder, dtype=torch.float32).to(self.device).eval()
        self.pooling = read_pooling(folder, self.model.config.to_dict())
        self.dimension = int(getattr(self.model.config, "hidden_size", 0) or 0)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.prompt_byte_limit = limits.tokenizer_byte_limit(
            self.tokenizer, self.pooling.max_seq_length, limits.max_prompt_bytes_parameter(model.parameters)
        )
        tok = self.tokenizer
        llm_info.publish(
            model.ctx,
            llm_info.LLMInfo(
                context_length=self.pooling.max_seq_length,
                prompt_byte_limit=self.prompt_byte_limit,
                tokenize=lambda text, add_special=False: list(
                    tok(text, add_special_tokens=add_special)["input_ids"]
                ),
                detokenize=lambda ids: tok.decode(ids),
                extra={"engine": "transformers", "task": "embed", "dimension": self.dimension},
            ),
        )
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"embed-{model.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    # ---- requests ----
    def submit(self, request: InferenceRequest, sender: ResponseSender) -> None:
        try:
            req = vllm_request.parse(request)
            if req.embedding is None:
                raise InvalidArgument(
                    f"model '{self.name}' is an embedding model: it answers embedding requests (/v1/embeddings), "
                    "not generation"
                )
            self._jobs.put(_Job(req, self._ids(req.embedding), sender))
        except NaiadError as exc:
            sender.send(error=exc, final=True)
        except Exception as exc:  # a tokenizer's own error: the request's, never the server's
            sender.send(error=InvalidArgument(f"{type(exc).__name__}: {exc}"), final=True)

    def _ids(self, spec: dict[str, Any]) -> list[int]:
        source = spec.get("input")
        if isinstance(source, str):
            limits.check_prompt(source, self.prompt_byte_limit, self.pooling.max_seq_length)
            ids = list(self.tokenizer(source)["input_ids"])
        elif isinstance(source, list) and source and all(isinstance(i, int) for i in source):
            ids = list(source)
            if any(not 0 <= i < len(self.tokenizer) for i in ids):
                raise InvalidArgument(
                    f"a token id of 'input' is outside the vocabulary (0..{len(self.tokenizer) - 1})"
                )
        else:
            raise InvalidArgument("embedding_request 'input' must be a string or a list of token ids")
        if not ids:
            raise InvalidArgument("embedding_request 'input' is empty")
        limit = self.pooling.max_seq_length
        if limit and len(ids) > limit:
            raise InvalidArgument(
                f"This model's maximum context length is {limit} tokens. However, your input has {len(ids)} "
                "tokens. Please reduce the length of the input."
            )
        dims = (spec.get("pooling_params") or {}).get("dimensions")
        if isinstance(dims, list):
            dims = dims[0] if dims else None
        if dims is not None:
            if not self.pooling.matryoshka:
                raise InvalidArgument(
                    f'Model "{self.name}" does not support matryoshka representation, changing output dimensions '
                    "will lead to poor results."
                )
            if not isinstance(dims, int) or not 0 < dims <= self.dimension:
                raise InvalidArgument(f"dimensions must be an integer in [1, {self.dimension}], got {dims!r}")
        return ids

    # ---- the engine thread ----
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch = [job]
            while len(batch) < MAX_BATCH:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)  # (seen again after this batch: the engine stops then)
                    break
                batch.append(more)
            live = [j for j in batch if not j.sender.is_cancelled()]
            try:
                vectors = self.embed([j.ids for j in live]) if live else []
            except Exception as exc:  # the forward failed: every request of the batch is told
                log.exception("model '%s': embedding failed", self.name)
                for j in live:
                    j.sender.send(
                        error=Unavailable(f"model '{self.name}': embedding failed: {exc}"), final=True
                    )
                continue
            for j, vector in zip(live, vectors):
                dims = (j.req.embedding or {}).get("pooling_params", {}).get("dimensions")
                if isinstance(dims, list):
                    dims = dims[0] if dims else None
                if dims:
                    vector = vector[:dims]
                    if self.pooling.normalize:  # (a truncated Matryoshka vector is normalised again)
                        norm = sum(v * v for v in vector) ** 0.5 or 1.0
                        vector = [v / norm for v in vector]
                out = vllm_request.outputs(j.req, json.dumps(vector), num_input_tokens=len(j.ids))
                j.sender.send(out, final=True)

    def embed(self, batch: list[list[int]]) -> list[list[float]]:
        """One forward over the padded batch; each row pooled over its own tokens."""
        torch = self.torch
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = 1
        with torch.inference_mode():
            hidden = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))[0].float()
            pooled = pool(torch, hidden, mask.to(self.device), self.pooling.mode)
            if self.pooling.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu().tolist()


def pool(torch: Any, hidden: Any, mask: Any, mode: str) -> Any:
    """sentence-transformers' pooling of token embeddings [batch, tokens, dim] under an attention mask."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    expanded = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(expanded == 0, -1e9).max(dim=1).values
    summed = (hidden * expanded).sum(dim=1)
    counts = expanded.sum(dim=1).clamp(min=1e-9)
    return summed / (counts.sqrt() if mode == "mean_sqrt_len" else counts)
