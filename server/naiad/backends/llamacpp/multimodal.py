"""Images on the llama.cpp engine: llama.cpp's multimodal library (libmtmd, bound as `llama_cpp.mtmd_cpp`).

A model with a multimodal projector (`mmproj`: a parameter naming its GGUF, or `mmproj.gguf` in the version folder)
gets an mtmd context over the engine's text model (`mtmd_init_from_file`), as llama-server does with `--mmproj`.
A request with images is tokenized by `mtmd_tokenize`: the prompt's text holds mtmd's marker (`<__media__>`) where
each image goes, and comes back as text chunks (token ids) and image chunks (the image preprocessed: resized and
normalised as the projector wants it). Its prompt is then a list of token ids in which each image stands as its
positions' ids (`n_pos` of them: the embeddings it becomes, or fewer for an M-RoPE model): negative numbers that
no vocabulary token has, the same for the same image (keyed by its bytes) and different for different images, so
the engine's prefix reuse, which compares cached ids, never takes cells computed for another image, and takes
those of the same image as a whole.

The engine thread evaluates an image when it reaches the head of its slot's pending prompt (`evaluate`, each step,
before the step's batch is built): `mtmd_helper_eval_chunk_single` encodes it (the vision tower and projector) and
decodes its embeddings into the slot's sequence at the slot's next position, under the request's LoRA adapters;
the text around it goes into the step's batched decode with every other sequence's tokens, as any prompt does.
An image is evaluated alone, between two batched decodes (as llama-server does), so a large vision tower holds
the other sequences for its encode.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

from ...errors import InvalidArgument
from ...llm import limits

log = logging.getLogger("naiad.llamacpp")

PARAMETER = "mmproj"  # the config parameter naming the projector's GGUF (relative: the version folder's)
DEFAULT_FILE = "mmproj.gguf"  # found in the version folder without the parameter
TEXT, IMAGE = 0, 1  # mtmd_input_chunk_type
KNOWN_IMAGES = (
    4096  # images whose ids the engine remembers (prefix reuse of the same image); older ones get new ids
)

_captured = threading.local()  # .lines: libmtmd's errors on this thread while a call's reason is wanted


def _mtmd_log(level: int, text: bytes, _user) -> None:
    """libmtmd's log (clip, preprocessing, the helper's decodes): errors kept for the call that wants its reason
    and logged, warnings at debug level, the rest dropped."""
    line = text.decode("utf-8", "replace").rstrip()
    if level == 4:
        lines = getattr(_captured, "lines", None)
        if lines is not None:
            lines.append(line)
        log.error("libmtmd: %s", line)
    elif level == 3:
        log.debug("libmtmd: %s", line)


_log_callback: Any = None  # the ctypes callback, kept referenced for as long as the process lives
_log_lock = threading.Lock()


def _mtmd():
    global _log_callback
    try:
        import llama_cpp
        from llama_cpp import mtmd_cpp
    except (ImportError, OSError) as exc:
        raise InvalidArgument(
            f"this llama-cpp-python has no multimodal library (llama_cpp.mtmd_cpp, libmtmd): {exc}"
        ) from None
    with _log_lock:
        if _log_callback is None:
            _log_callback = llama_cpp.llama_log_callback(_mtmd_log)
            mtmd_cpp.mtmd_log_set(_log_callback, ctypes.c_void_p(0))
            mtmd_cpp.mtmd_helper_log_set(_log_callback, ctypes.c_void_p(0))
    return mtmd_cpp


def mmproj_path(parameters: dict[str, str], version_path: Path) -> Path | None:
    """The projector GGUF of a model: parameter `mmproj` (relative to the version folder), else `mmproj.gguf` there;
    None for a text-only model. A parameter naming no file is InvalidArgument."""
    named = (parameters.get(PARAMETER) or "").strip()
    if named:
        path = Path(named)
        path = path if path.is_absolute() else version_path / path
        if not path.is_file():
            raise InvalidArgument(f"parameter '{PARAMETER}': no file at {path}")
        return path
    default = version_path / DEFAULT_FILE
    return default if default.is_file() else None


def _reason(lines: list[str]) -> str:
    return "; ".join(line.split(": ", 1)[-1] for line in lines if line) or "see the server log"


class MediaPrompt:
    """A prompt with images as the engine runs it: `tokens` (text token ids, and each image's position ids) and the
    image chunks to evaluate, by the index of their first position in `tokens`. Owns mtmd's chunks (freed once
    every image is evaluated, or with the request)."""

    def __init__(self, mtmd: Any, chunks: Any, tokens: list[int], spans: dict[int, tuple[Any, int]]):
        self._mtmd = mtmd
        self._chunks = chunks
        self.tokens = tokens
        self.spans = spans  # first position's index -> (image chunk, positions)
        self._left = len(spans)

    def boundary(self, keep: int) -> int:
        """`keep` cached positions moved back to the start of the image it would cut (an image is evaluated whole)."""
        for start, (_, n_pos) in self.spans.items():
            if start < keep < start + n_pos:
                return start
        return keep

    @staticmethod
    def text_run(pending: list[int], budget: int) -> int:
        """How many of `pending`'s first ids (at most `budget`) are text, before the next image."""
        n = min(budget, len(pending))
        for i in range(n):
            if pending[i] < 0:
                return i
        return n

    def evaluated(self) -> None:
        self._left -= 1
        if self._left <= 0:
            self.close()

    def close(self) -> None:
        chunks, self._chunks = self._chunks, None
        if chunks is not None:
            self._mtmd.mtmd_input_chunks_free(chunks)

    def __del__(self) -> None:
        self.close()


class Media:
    """An engine's mtmd context: tokenizes prompts with images (any thread) and evaluates their images into the
    engine's sequences (the engine thread)."""

    def __init__(self, engine: Any, path: Path):
        self._mtmd = mtmd = _mtmd()
        self.engine = engine
        self.path = path
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False  # the engine's text model is on the CPU (or its RPC servers)
        params.n_threads = engine.settings.n_threads
        params.print_timings = False
        params.warmup = True
        _captured.lines = []
        try:
            self.ctx = mtmd.mtmd_init_from_file(str(path).encode(), engine.model, params)
            reasons = _captured.lines
        finally:
            _captured.lines = None
        if not self.ctx:
            raise InvalidArgument(
                f"llama.cpp could not load the multimodal projector '{path}': {_reason(reasons)}"
            )
        if not mtmd.mtmd_support_vision(self.ctx):
            mtmd.mtmd_free(self.ctx)
            self.ctx = None
            raise InvalidArgument(
                f"the multimodal projector '{path}' has no vision encoder (audio is not served)"
            )
        self.marker = (mtmd.mtmd_default_marker() or b"<__media__>").decode()
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self.ctx))
        self._ids: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()
        self._next_id = 1
        self._ids_lock = threading.Lock()

    def _image_ids(self, key: str, n_pos: int) -> list[int]:
        """The position ids of an image (the same for the same bytes and positions), never a vocabulary id."""
        with self._ids_lock:
            base = self._ids.get((key, n_pos))
            if base is None:
                base = self._next_id
                self._next_id += n_pos
                self._ids[(key, n_pos)] = base
                if len(self._ids) > KNOWN_IMAGES:
                    self._ids.popitem(last=False)
            else:
                self._ids.move_to_end((key, n_pos))
        return [-(base + i) for i in range(n_pos)]

    def tokenize(self, prompt: str, images: list[tuple[bytes, Any]]) -> MediaPrompt:
        """`prompt` (mtmd's marker where each image goes) and its images ((encoded bytes, Pillow RGB image) each) as
        a MediaPrompt; InvalidArgument for markers and images that do not match, or an image mtmd cannot
        preprocess."""
        mtmd = self._mtmd
        engine = self.engine
        limits.check_prompt(prompt, engine.prompt_byte_limit, engine.n_ctx)
        markers = prompt.count(self.marker)
        if markers != len(images):
            raise InvalidArgument(
                f"the prompt has {markers} image markers ('{self.marker}') but the request has {len(images)} images: "
                "put one marker where each image goes"
            )
        bitmaps = []
        try:
            for _, image in images:
                rgb = image.tobytes()  # RGBRGB..., what mtmd_bitmap_init copies
                data = ctypes.cast(ctypes.c_char_p(rgb), ctypes.POINTER(ctypes.c_uint8))
                bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, data)
                if not bitmap:
                    raise InvalidArgument("llama.cpp could not take an image (mtmd_bitmap_init)")
                bitmaps.append(bitmap)
            text_bytes = prompt.encode("utf-8")
            text = mtmd.mtmd_input_text(
                text=text_bytes, text_len=len(text_bytes), add_special=True, parse_special=True
            )
            chunks = mtmd.mtmd_input_chunks_init()
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            _captured.lines = []
            try:
                rc = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), array, len(bitmaps))
                reasons = _captured.lines
            finally:
                _captured.lines = None
        finally:
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)
        prompt_out = MediaPrompt(mtmd, chunks, [], {})  # owns the chunks from here on (freed if this fails)
        if rc != 0:
            raise InvalidArgument(
                f"llama.cpp could not tokenize the prompt with its images: {_reason(reasons)}"
            )
        tokens = prompt_out.tokens
        n_images = 0
        last = TEXT
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            last = mtmd.mtmd_input_chunk_get_type(chunk)
            if last == TEXT:
                n = ctypes.c_size_t(0)
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                tokens.extend(ids[j] for j in range(n.value))
            elif last == IMAGE:
                n_pos = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))
                prompt_out.spans[len(tokens)] = (chunk, n_pos)
                key = hashlib.sha256(images[n_images][0]).hexdigest()
                tokens.extend(self._image_ids(key, n_pos))
                n_images += 1
            else:
                raise InvalidArgument("llama.cpp made a prompt chunk that is neither text nor image")
        prompt_out._left = len(prompt_out.spans)
        if last != TEXT:
            raise InvalidArgument("the prompt ends with an image: put text (the generation prompt) after it")
        return prompt_out

    def evaluate(self) -> None:
        """(engine thread) Evaluate the image at the head of each running slot's pending prompt into its sequence."""
        engine = self.engine
        for slot in engine.slots:
            req = slot.request
            media = getattr(req, "media", None)
            if media is None or not slot.pending or slot.pending[0] >= 0:
                continue
            start = len(req.prompt) - len(slot.pending)
            span = media.spans.get(start)
            n_past = len(slot.tokens)
            rc = -1
            if span is not None:
                chunk, n_pos = span
                engine._set_adapters(req.adapters)
                new_past = ctypes.c_int32(0)
                rc = self._mtmd.mtmd_helper_eval_chunk_single(
                    self.ctx, engine.ctx, chunk, n_past, slot.seq, engine.settings.n_batch, False,
                    ctypes.byref(new_past),
                )  # fmt: skip
                if rc == 0 and new_past.value != n_past + n_pos:
                    rc = -2
            if rc != 0:
                # what was decoded of the image is not in slot.tokens: take its cells out of the sequence too
                engine._lc.llama_memory_seq_rm(engine.memory, slot.seq, n_past, -1)
                engine._release(slot)
                engine._finish_metrics(req, "abort")
                error = RuntimeError(f"llama.cpp could not evaluate an image of the prompt (code {rc})")
                try:
                    req.fail(error)
                except Exception:
                    log.exception("llama.cpp engine: a response callback failed")
                continue
            slot.tokens.extend(slot.pending[:n_pos])
            del slot.pending[:n_pos]
            media.evaluated()

    def close(self) -> None:
        if self.ctx:
            self._mtmd.mtmd_free(self.ctx)
            self.ctx = None
