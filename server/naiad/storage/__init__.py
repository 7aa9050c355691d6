"""Where model repositories live: a local folder, an s3:// bucket or an https:// archive; open_repository() picks."""

from __future__ import annotations

import os
from pathlib import Path

from .base import ModelSource, RepositorySource, StorageError
from .local import LocalRepository

__all__ = ["ModelSource", "RepositorySource", "StorageError", "default_cache_dir", "open_repository"]


def default_cache_dir() -> Path:
    """Where remote models are copied: $NAIAD_STORAGE_CACHE_DIR, tritonserver's $TRITON_AWS_MOUNT_DIRECTORY, else
    ~/.cache/naiad/storage."""
    env = os.environ.get("NAIAD_STORAGE_CACHE_DIR") or os.environ.get("TRITON_AWS_MOUNT_DIRECTORY")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "naiad" / "storage"


def open_repository(location: str, cache_dir: Path | None = None) -> RepositorySource:
    """A source for one --model-repository value: s3://..., https://....tar.gz|.zip, or a local path."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if location.startswith("s3://"):
        from .s3 import S3Repository

        return S3Repository(location, cache)
    if location.startswith(("https://", "http://")):
        from .archive import ArchiveRepository

        return ArchiveRepository(location, cache)
    if "://" in location and not location.startswith("file://"):
        raise StorageError(
            f"model repository '{location}': unsupported scheme (use a path, s3:// or https://)"
        )
    return LocalRepository(location[len("file://") :] if location.startswith("file://") else location)
