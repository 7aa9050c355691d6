"""Model repository: discovery, version policy, and the load/unload lifecycle for control modes none|poll|explicit."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tritonclient.grpc import model_config_pb2 as mc

from . import backends, storage
from . import config as cfg
from .backends.base import ModelContext, ModelInstance
from .errors import InvalidArgument, NaiadError, NotFound, Unavailable, as_naiad_error
from .model import ModelVersion
from .orchestration.model_settings import ModelSettings, model_settings
from .scheduling.pool import InstancePool
from .scheduling.scheduler import create_scheduler
from .stats import ModelStats
from .storage.local import numeric_versions, tree_signature

if TYPE_CHECKING:
    from .orchestration.orchestrator import ModelOrchestrator

log = logging.getLogger("naiad.repository")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"


def select_versions(policy: mc.ModelVersionPolicy, available: list[int]) -> list[int]:
    if policy.HasField("all"):
        return list(available)
    if policy.HasField("specific"):
        return sorted(v for v in policy.specific.versions if v in available)
    n = policy.latest.num_versions or 1
    return sorted(available)[-n:]


@dataclass
class ModelRecord:
    """What the repository knows about one model name."""

    name: str
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    state: str = UNAVAILABLE
    reason: str = ""
    config: mc.ModelConfig | None = None
    version_states: dict[int, tuple[str, str]] = field(default_factory=dict)
    signature: tuple = ()
    override_dir: Path | None = None
    load_seconds: float = 0.0
    explicit: bool = False  # loaded by its own name (startup list, load API), not only as a composing model
    settings: ModelSettings = field(default_factory=ModelSettings)  # NAIAD_MEMORY, NAIAD_PINNED, ...
    memory: dict[str, int] = field(default_factory=dict)  # measured bytes per device ('host', 'gpu0', ...)
    memory_measured: bool = False  # (kept across unloads: the next load is admitted with it)
    loaded_at: float = 0.0  # wall-clock time of the last successful load
    cause: str = ""  # why it was last loaded: startup, explicit, poll, on_demand


class ModelRepository:
    """Owns every loaded model. All mutation happens on the event loop; builds run in worker threads."""

    def __init__(
        self,
        paths: list[str],
        server,
        auto_complete: bool = True,
        gpu_count: int = 0,
        cache_dir: str | None = None,
    ):
        try:
            self.sources = [storage.open_repository(p, Path(cache_dir) if cache_dir else None) for p in paths]
        except storage.StorageError as exc:
            raise InvalidArgument(str(exc)) from None
        self.source_errors: dict[str, str] = {}  # remote repository URI -> why its last listing failed
        self.server = server
        self.auto_complete = auto_complete
        self.gpu_count = gpu_count
        self.records: dict[str, ModelRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.on_change: list = []  # callbacks(name) after load/unload, e.g. metrics
        self.orchestrator: ModelOrchestrator | None = (
            None  # budget, measurement, eviction (set by the Server)
        )

    # ---- discovery ----
    def scan(self) -> dict[str, storage.ModelSource]:
        """Every model in every repository: local folders as they are now, remote ones as last refreshed."""
        found: dict[str, storage.ModelSource] = {}
        for source in self.sources:
            for name, model in source.models().items():
                if name in found:
                    log.error(
                        "model '%s' appears in more than one repository (%s and %s); using the first",
                        name,
                        found[name].uri,
                        model.uri,
                    )
                    continue
                found[name] = model
        return found

    def refresh_sources(self) -> None:
        """List every remote repository again (blocking: call off the event loop). A failed listing keeps the
        previous one and is remembered, so that a load of a model that is not listed can say why."""
        for source in self.sources:
            if not source.remote:
                continue
            try:
                source.refresh()
            except storage.StorageError as exc:
                if self.source_errors.get(source.uri) != str(exc):
                    log.error("cannot list model repository %s", exc)
                self.source_errors[source.uri] = str(exc)
            else:
                self.source_errors.pop(source.uri, None)

    async def refresh(self) -> None:
        if any(s.remote for s in self.sources):
            await asyncio.get_running_loop().run_in_executor(None, self.refresh_sources)

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    # ---- lookup ----
    def get(self, name: str, version: int = -1) -> ModelVersion:
        """The ready version asked for (-1: the latest); Triton's NOT_FOUND / UNAVAILABLE errors otherwise."""
        rec = self.records.get(name)
        if rec is None:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        if version <= 0:
            if version == 0:
                raise NotFound(f"Request for unknown model: '{name}' version 0 is not found")
            if not rec.versions:
                raise NotFound(f"Request for unknown model: '{name}' has no available versions")
            return rec.versions[max(rec.versions)]
        mv = rec.versions.get(version)
        if mv is None:
            if version in rec.version_states or (not rec.versions and rec.reason):
                raise Unavailable(
                    f"Request for unknown model: '{name}' version {version} is not at ready state"
                )
            raise NotFound(f"Request for unknown model: '{name}' version {version} is not found")
        return mv

    def is_ready(self, name: str, version: int = -1) -> bool:
        try:
            self.get(name, version)
            return True
        except NaiadError:
            return False

    # ---- lifecycle ----
    async def load(
        self,
        name: str,
        config_json: str | dict | None = None,
        files: dict[str, bytes] | None = None,
        _chain: tuple = (),
        refresh: bool = True,
        cause: str = "explicit",
    ) -> None:
        """Load (or reload) a model; new versions go live before old ones are drained and unloaded.

        An ensemble's composing models are loaded first when they are not loaded yet (as Triton does). Remote
        repositories are listed again first (unless the caller just did), so a load sees the bucket as it is now.
        `cause` (startup, explicit, poll, on_demand) labels the load in the metrics.
        """
        loop = asyncio.get_running_loop()
        if refresh:
            await self.refresh()
        for step_model in await loop.run_in_executor(None, self._composing_models, name, config_json):
            if step_model in _chain:
                raise InvalidArgument(f"ensemble '{name}' depends on itself through '{step_model}'")
            if not self.is_ready(step_model):
                await self.load(step_model, _chain=_chain + (name,), refresh=False, cause=cause)
        orch = self.orchestrator
        async with self._lock(name):
            rec = self.records.setdefault(name, ModelRecord(name))
            rec.state, rec.reason, rec.cause = LOADING, "", cause
            started = time.monotonic()
            ticket = None
            try:
                if orch is not None:
                    config = await loop.run_in_executor(None, self._config_to_load, name, config_json)
                    ticket = await orch.admit(rec, config, cause)
                model_dir, signature = await loop.run_in_executor(None, self._model_dir, name, rec, files)
                config, built = await loop.run_in_executor(None, self._build, name, model_dir, config_json)
            except BaseException as exc:
                if orch is not None:
                    orch.failed(ticket, name, cause, time.monotonic() - started)
                err = as_naiad_error(exc)
                rec.reason = err.message
                rec.state = READY if rec.versions else UNAVAILABLE
                if not rec.versions:
                    found = self.scan().get(name)
                    if found is None and not rec.version_states and rec.override_dir is None:
                        # A name in no repository (and never loaded) leaves no entry in the index.
                        del self.records[name]
                    latest = found.versions()[-1:] if found is not None else []
                    rec.version_states = {v: (UNAVAILABLE, err.message) for v in latest}
                log.error("failed to load '%s': %s", name, err.message)
                self._changed(name)
                raise err from None
            old = rec.versions
            rec.versions = built
            rec.config = config
            rec.state, rec.reason = READY, ""
            rec.explicit = rec.explicit or not _chain
            rec.version_states = {v: (READY, "") for v in built}
            for v in old:
                if v not in built:
                    rec.version_states[v] = (UNAVAILABLE, "unloaded")
            rec.signature = signature
            rec.load_seconds = time.monotonic() - started
            rec.settings = model_settings(config)
            if orch is not None and ticket is not None:
                orch.loaded(ticket, rec, rec.load_seconds)
            log.info("successfully loaded '%s' version(s) %s", name, ", ".join(map(str, sorted(built))))
            self._changed(name)
        for mv in old.values():
            await mv.close(self.server.options.exit_timeout_secs)
        if orch is not None:
            too_big = await orch.settle(name)
            if too_big is not None:
                await self.unload(name)
                rec.reason = f"failed to load '{name}', {too_big}"
                rec.version_states = {v: (UNAVAILABLE, rec.reason) for v in rec.version_states}
                raise InvalidArgument(rec.reason)

    async def ensure_loaded(self, name: str, cause: str) -> None:
        """Load `name` unless it is ready; a load already under way is waited for, not repeated."""
        lock = self._lock(name)
        if lock.locked():
            async with lock:
                pass
        if not self.is_ready(name):
            await self.load(name, cause=cause)

    def busy(self, name: str) -> bool:
        """Whether the model is being loaded or unloaded right now."""
        lock = self._locks.get(name)
        return lock is not None and lock.locked()

    def listed(self, name: str) -> bool:
        """Whether a repository holds `name` (remote ones as last listed) or it was loaded with file overrides."""
        rec = self.records.get(name)
        return (rec is not None and rec.override_dir is not None) or name in self.scan()

    def _config_to_load(self, name: str, config_json) -> mc.ModelConfig | None:
        """The config a load will use, for admission (None when it cannot be read: the load reports why)."""
        try:
            if config_json:
                return cfg.parse_json(config_json)
            return self._listed_config(name)
        except (NaiadError, storage.StorageError, OSError):
            return None

    def _composing_models(self, name: str, config_json) -> list[str]:
        try:
            if config_json:
                config = cfg.parse_json(config_json)
            else:
                config = self._listed_config(name)
        except NaiadError:
            return []  # the load itself reports the error
        if config is None or config.platform != "ensemble":
            return []
        return list(dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step if s.model_name))

    def _listed_config(self, name: str) -> mc.ModelConfig | None:
        """The config.pbtxt of a model as its repository holds it (may read the network: off the loop)."""
        source = self.scan().get(name)
        if source is None:
            return None
        text = source.config_text()
        return cfg.parse_text(text, f"{source.uri}/config.pbtxt") if text is not None else None

    def _model_dir(self, name: str, rec: ModelRecord, files: dict[str, bytes] | None) -> tuple[Path, tuple]:
        """The local directory to load from (remote models are fetched first) and its change signature.
        Worker thread."""
        if files:
            if rec.override_dir is not None:
                shutil.rmtree(rec.override_dir, ignore_errors=True)
            root = Path(tempfile.mkdtemp(prefix=f"naiad-{name}-"))
            model_dir = root / name
            try:
                for rel, content in files.items():
                    target = (model_dir / rel).resolve()
                    if not str(target).startswith(str(model_dir.resolve()) + os.sep):
                        raise InvalidArgument(f"file override path '{rel}' escapes the model directory")
                    try:
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(content)
                    except OSError as exc:  # e.g. a name too long for the file system: the client's input
                        raise InvalidArgument(
                            f"failed to load '{name}', cannot write file override 'file:{rel}': "
                            f"{exc.strerror or exc}"
                        ) from None
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                raise
            rec.override_dir = root
            return model_dir, tree_signature(model_dir)
        if rec.override_dir is not None:
            return rec.override_dir / name, rec.signature
        found = self.scan().get(name)
        if found is None:
            causes = "; ".join(self.source_errors.values())
            raise InvalidArgument(
                f"failed to load '{name}', failed to poll from model repository"
                + (f": {causes}" if causes else "")
            )
        signature = found.signature()
        try:
            return found.fetch(), signature
        except storage.StorageError as exc:
            raise InvalidArgument(str(exc)) from None

    def _build(
        self, name: str, model_dir: Path, config_json
    ) -> tuple[mc.ModelConfig, dict[int, ModelVersion]]:
        """Parse, auto-complete and normalise the config, then create every selected version. Worker thread."""
        if config_json:
            try:
                config = cfg.parse_json(config_json, "the 'config' parameter")
            except NaiadError as exc:  # clients match on Triton's "failed to load '<model>', " prefix
                raise InvalidArgument(f"failed to load '{name}', {exc.message}") from None
        else:
            config = cfg.load_file(model_dir) or mc.ModelConfig()
        if not config.name:
            config.name = name
        elif config.name != name:
            raise InvalidArgument(
                f"model name '{config.name}' in {model_dir / 'config.pbtxt'} does not match the model "
                f"directory name '{name}'"
            )
        available = numeric_versions(model_dir)
        cfg.detect_backend(config, model_dir, available)
        if config.platform != "ensemble":
            backend = backends.get(config.backend)  # an unknown backend fails here, naming the known ones
            if self.auto_complete and available:
                filename = backend.model_filename(config)
                model_file = model_dir / str(max(available)) / filename if filename else None
                if model_file is None or model_file.exists():
                    backend.auto_complete_config(config, model_file)
        cfg.normalize(config, self.gpu_count)
        model_settings(config)  # a bad orchestration parameter fails the load
        versions = select_versions(config.version_policy, available)
        if not versions:
            raise InvalidArgument(
                f"at least one version must be available under the version policy of model '{name}' "
                f"(found version folders: {available or 'none'})"
            )
        built: dict[int, ModelVersion] = {}
        try:
            for v in versions:
                built[v] = self._build_version(config, model_dir, v)
        except BaseException:
            for mv in built.values():
                if mv.pool is not None:
                    mv.pool.close()
            raise
        return config, built

    def _build_version(self, config: mc.ModelConfig, model_dir: Path, version: int) -> ModelVersion:
        vconfig = mc.ModelConfig()
        vconfig.CopyFrom(config)
        ctx = ModelContext(
            name=config.name,
            version=version,
            config=vconfig,
            model_dir=model_dir,
            version_dir=model_dir / str(version),
            server=self.server,
            loop=self.server.loop,
        )
        stats = ModelStats(config.name, str(version))
        for hook in self.server.stats_observers:
            stats.observers.append(hook)
        if config.platform == "ensemble":
            mv = ModelVersion(ctx, None, create_scheduler(ctx, None, stats, self.server))
            self.server.warmup(mv)
            return mv
        backend = backends.get(config.backend)
        filename = backend.model_filename(vconfig)
        if filename and not (ctx.version_dir / filename).exists():
            raise InvalidArgument(
                f"model '{config.name}' version {version}: {filename} not found in {ctx.version_dir}"
            )
        instances: list[ModelInstance] = []
        try:
            for group in vconfig.instance_group:
                devices = list(group.gpus) if group.kind == mc.ModelInstanceGroup.KIND_GPU else [0]
                for device in devices:
                    for _i in range(group.count):
                        instances.append(backend.create_instance(ctx, group, device, len(instances)))
            pool = InstancePool(instances, stats, vconfig.max_batch_size > 0, self.server.rate_limiter)
            pool.initialize()
            mv = ModelVersion(ctx, pool, create_scheduler(ctx, pool, stats, self.server))
        except BaseException:
            for inst in instances:
                try:
                    inst.close()
                except Exception:
                    pass
            raise
        try:
            self.server.warmup(mv)
        except BaseException:
            pool.close()
            raise
        return mv

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        async with self._lock(name):
            rec = self.records.get(name)
            if rec is None or not rec.versions:
                # Triton answers 200 for unloading a model that is not loaded (or does not exist).
                if rec is not None:
                    rec.state, rec.reason = UNAVAILABLE, "unloaded"
                return
            old = rec.versions
            rec.versions = {}
            rec.explicit = False
            rec.state, rec.reason = UNLOADING, ""
            self._changed(name)
        for mv in old.values():
            await mv.close(self.server.options.exit_timeout_secs)
        rec.state, rec.reason = UNAVAILABLE, "unloaded"
        rec.version_states = {v: (UNAVAILABLE, "unloaded") for v in old}
        if rec.override_dir is not None:
            shutil.rmtree(rec.override_dir, ignore_errors=True)
            rec.override_dir = None
        log.info("successfully unloaded '%s'", name)
        self._changed(name)
        if unload_dependents and rec.config is not None and rec.config.platform == "ensemble":
            # As Triton: the composing models loaded only for this ensemble go with it (nested ones too);
            # a model loaded by its own name stays.
            for step in _steps(rec.config):
                await self._unload_composing(step)
        if unload_dependents:
            for other in list(self.records.values()):
                if (
                    other.config is not None
                    and other.config.platform == "ensemble"
                    and other.versions
                    and any(s.model_name == name for s in other.config.ensemble_scheduling.step)
                ):
                    await self.unload(other.name)

    async def _unload_composing(self, name: str) -> None:
        rec = self.records.get(name)
        if rec is None or not rec.versions or rec.explicit:
            return
        if any(
            name in _steps(o.config) for o in self.records.values() if o.versions and o.config is not None
        ):
            return  # still composes another loaded ensemble
        config = rec.config
        await self.unload(name)
        if config is not None:
            for step in _steps(config):
                await self._unload_composing(step)

    def _changed(self, name: str) -> None:
        for cb in self.on_change:
            cb(name)

    async def load_many(
        self, names: list[str], cause: str = "startup", configs: dict[str, dict] | None = None
    ) -> None:
        """Load models concurrently (a model in `configs` with that config override); failures are recorded and
        logged, never fatal to the others. The caller has just refreshed the repositories' listings."""
        ordered = await asyncio.get_running_loop().run_in_executor(None, self._dependency_order, names)
        configs = configs or {}
        for wave in ordered:
            await asyncio.gather(*(self._load_quietly(n, cause, configs.get(n)) for n in wave))

    async def _load_quietly(self, name: str, cause: str, config: dict | None = None) -> None:
        try:
            await self.load(name, config, refresh=False, cause=cause)
        except NaiadError:
            pass

    def _dependency_order(self, names: list[str]) -> list[list[str]]:
        """Ensembles load after the models they call: plain models first, ensembles after."""
        plain: list[str] = []
        ensembles: list[str] = []
        for n in names:
            try:
                c = self._listed_config(n)
            except NaiadError:
                c = None
            (ensembles if c is not None and c.platform == "ensemble" else plain).append(n)
        return [w for w in (plain, ensembles) if w]

    async def poll(self) -> None:
        """Poll mode: load new models, reload changed ones, unload removed ones. A remote repository that cannot
        be listed keeps its models as they are."""
        await self.refresh()
        found = self.scan()
        for name in list(self.records):
            rec = self.records[name]
            if name not in found and rec.override_dir is None and rec.versions:
                await self.unload(name)
        changed = []
        for name, source in found.items():
            known = self.records.get(name)
            if known is None or (known.override_dir is None and source.signature() != known.signature):
                changed.append(name)
        if changed:
            await self.load_many(changed, cause="poll")

    def index(self, ready_only: bool = False, memory: bool = False) -> list[dict]:
        """Triton's repository index: a bare `{"name"}` for models never loaded; `reason` only when set.
        `memory`: READY entries also carry `host_memory_bytes` and `gpu_memory_bytes` (all GPUs; per device in
        `gpu_memory_bytes_by_device`), measured after load and warm-up, declared (NAIAD_MEMORY) until then."""
        out = []
        for name in sorted(set(self.scan()) | set(self.records)):
            rec = self.records.get(name)
            if rec is None or not (rec.version_states or rec.state != UNAVAILABLE or rec.reason):
                if not ready_only:
                    out.append({"name": name})
                continue
            states = rec.version_states or {0: (rec.state, rec.reason)}
            for v, (state, reason) in sorted(states.items()):
                if rec.versions.get(v) is not None:
                    state, reason = READY, ""
                elif rec.state in (LOADING, UNLOADING):
                    state = rec.state
                if ready_only and state != READY:
                    continue
                entry = {"name": name, "version": str(v) if v else "", "state": state}
                if reason:
                    entry["reason"] = reason
                if memory and state == READY and self.orchestrator is not None:
                    entry.update(self.orchestrator.index_fields(rec))
                out.append(entry)
        return out

    async def close(self, timeout: float | None = None) -> None:
        for rec in list(self.records.values()):
            versions, rec.versions = rec.versions, {}
            for mv in versions.values():
                await mv.close(timeout)
            if rec.override_dir is not None:
                shutil.rmtree(rec.override_dir, ignore_errors=True)


def _steps(config: mc.ModelConfig) -> list[str]:
    """The models an ensemble's steps call, in order, each once (empty for other models)."""
    if config.platform != "ensemble":
        return []
    return list(dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step if s.model_name))


def decode_file_overrides(parameters: dict) -> dict[str, bytes]:
    """`file:<path>` load parameters carry base64 content (HTTP) or raw bytes (gRPC)."""
    files = {}
    for key, value in parameters.items():
        if not key.startswith("file:"):
            continue
        rel = key[len("file:") :]
        if isinstance(value, (bytes, bytearray)):
            files[rel] = bytes(value)
        else:
            try:
                files[rel] = base64.b64decode(value, validate=True)
            except (ValueError, TypeError):
                raise InvalidArgument(f"load parameter '{key}' must be base64-encoded file content") from None
    return files
