"""The interface every repository location offers: list its models, describe one, and make a local copy."""

from __future__ import annotations

import abc
from pathlib import Path


class StorageError(Exception):
    """A repository location could not be read; the message names the URI and the cause."""


class ModelSource(abc.ABC):
    """One model directory in a repository. `fetch()` may block on the network: call it off the event loop."""

    name: str
    uri: str

    @abc.abstractmethod
    def versions(self) -> list[int]:
        """Numeric version folders, sorted, as listed (no download)."""

    @abc.abstractmethod
    def config_text(self) -> str | None:
        """The model's config.pbtxt, or None when it has none."""

    @abc.abstractmethod
    def signature(self) -> tuple:
        """Changes whenever the model's files change (poll mode's change detector)."""

    @abc.abstractmethod
    def fetch(self) -> Path:
        """A local directory holding a complete copy of the model."""


class RepositorySource(abc.ABC):
    """One --model-repository value."""

    uri: str
    remote: bool = False

    def refresh(self) -> None:
        """Read the listing again (remote sources; blocking). Raises StorageError."""

    @abc.abstractmethod
    def models(self) -> dict[str, ModelSource]:
        """The models as of the last refresh (remote) or as they are now (local)."""
