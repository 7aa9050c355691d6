"""A llamacpp model's LoRA adapters: those its config names (parameter `lora_adapters`, and Triton vllm_backend's
`multi_lora.json` in the version folder), loaded by every instance's engine with the model, and those loaded and
unloaded while it serves (the OpenAI frontend's `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`). The model's
LLMInfo publishes them as `extra["lora_adapters"]` (name -> the adapter file), which is how the OpenAI frontend lists
them under /v1/models and resolves `model: "<adapter>"` to this model.

An adapter is a GGUF as llama.cpp's `convert_lora_to_gguf.py` writes one (`general.type` "adapter", `adapter.type`
"lora", `<tensor>.lora_a`/`.lora_b` pairs); a path may name a folder holding exactly one `.gguf` file.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InvalidArgument, NotFound
from ...llm import info as llm_info
from ...llm import multi_lora
from ...llm.multi_lora import check_name

if TYPE_CHECKING:
    from .engine import LlamaEngine


def resolve_path(raw: Any, base: Path) -> Path:
    """The adapter GGUF `raw` names: a file, or a folder with exactly one `.gguf` in it; a relative path is taken
    from `base` (the model's version folder). NotFound (vLLM's "No adapter found") when there is none."""
    if not isinstance(raw, str) or not raw:
        raise InvalidArgument("a LoRA adapter's path must be a non-empty string")
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = base / path
    if path.is_dir():
        found = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(found) != 1:
            raise InvalidArgument(
                f"LoRA adapter folder '{raw}' must hold exactly one .gguf file (llama.cpp's adapter format, "
                f"convert_lora_to_gguf.py), it holds {len(found)}"
            )
        return found[0]
    if not path.is_file():
        raise NotFound(f"No adapter found at '{raw}'")
    return path


def static_adapters(parameters: dict[str, str], version_dir: Path) -> dict[str, Path]:
    """The adapters a model's config names: parameter `lora_adapters` (name=path,...) and multi_lora.json; a
    malformed entry, a name given twice or a missing file fails the load."""
    entries: list[tuple[str, Any]] = []
    for item in parameters.get("lora_adapters", "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise InvalidArgument(f"parameter 'lora_adapters': {item!r} is not name=path")
        entries.append((name.strip(), path.strip()))
    entries.extend(multi_lora.read(version_dir) or [])
    out: dict[str, Path] = {}
    for name, path in entries:
        check_name(name)
        if name in out:
            raise InvalidArgument(f"LoRA adapter '{name}' is named twice (lora_adapters, {multi_lora.FILE})")
        try:
            out[name] = resolve_path(path, version_dir)
        except NotFound as exc:
            raise InvalidArgument(f"LoRA adapter '{name}': {exc.message}") from None
    return out


class ModelAdapters:
    """One model's adapters and the engines (one per instance) that hold them. `published` is the LLMInfo's extra,
    whose llm_info.LORA_ADAPTERS is replaced (never changed in place) on every change, so readers on other threads see one
    state or the other."""

    def __init__(self, static: dict[str, Path], version_dir: Path):
        self.version_dir = version_dir
        self.paths: dict[str, str] = {name: str(path) for name, path in static.items()}
        self.engines: list[LlamaEngine] = []
        self.published: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def add_engine(self, engine: LlamaEngine) -> None:
        """An instance's engine: every adapter of the model is loaded into it (InvalidArgument when one fails)."""
        with self._lock:
            for name, path in self.paths.items():
                engine.load_adapter(name, path)
            self.engines.append(engine)

    def remove_engine(self, engine: LlamaEngine) -> None:
        with self._lock:
            if engine in self.engines:
                self.engines.remove(engine)

    def publish(self, extra: dict[str, Any]) -> None:
        with self._lock:
            self.published = extra
            extra[llm_info.LORA_ADAPTERS] = dict(self.paths)

    def _changed(self, paths: dict[str, str]) -> None:
        self.paths = paths
        if self.published is not None:
            self.published[llm_info.LORA_ADAPTERS] = dict(paths)

    def load(self, name: str, raw_path: str) -> None:
        """Load an adapter into every engine of the model (blocking: a file read per engine). InvalidArgument for a
        name taken or a file llama.cpp refuses, NotFound for a path with no file."""
        check_name(name)
        path = resolve_path(raw_path, self.version_dir)
        with self._lock:
            if name in self.paths:
                raise InvalidArgument(f"The lora adapter '{name}' has already been loaded.")
            done: list[LlamaEngine] = []
            try:
                for engine in self.engines:
                    engine.load_adapter(name, path)
                    done.append(engine)
            except BaseException:
                for engine in done:
                    engine.unload_adapter(name)
                raise
            self._changed({**self.paths, name: str(path)})

    def unload(self, name: str) -> None:
        """Unload an adapter from every engine (requests running under it finish first). NotFound when unknown."""
        with self._lock:
            if name not in self.paths:
                raise NotFound(f"The lora adapter '{name}' cannot be found.")
            for engine in self.engines:
                try:
                    engine.unload_adapter(name)
                except NotFound:
                    pass
            self._changed({k: v for k, v in self.paths.items() if k != name})
