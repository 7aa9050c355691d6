"""https:// archives of one model directory (.tar.gz, .tgz, .tar, .zip): fetched, checked, unpacked safely.

`https://host/path/<model>.tar.gz[#sha256=<hex>]` is a repository holding one model named after the file. The
archive holds the model directory's contents, or one folder that holds them. A member that would land outside its
folder (absolute path, `..`, a link pointing out, a device) refuses the whole archive.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import ssl
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from .base import ModelSource, RepositorySource, StorageError

log = logging.getLogger("naiad.storage")

SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
CHUNK = 1 << 20
TIMEOUT = 60


def _context() -> ssl.SSLContext:
    """The system's CAs, or the bundle named by SSL_CERT_FILE / AWS_CA_BUNDLE."""
    bundle = os.environ.get("SSL_CERT_FILE") or os.environ.get("AWS_CA_BUNDLE")
    return ssl.create_default_context(cafile=bundle or None)


def _safe_member(name: str) -> bool:
    path = PurePosixPath(name.replace("\\", "/"))
    return not path.is_absolute() and ".." not in path.parts and not (path.parts and ":" in path.parts[0])


def extract(archive: Path, dest: Path, uri: str) -> None:
    """Unpack `archive` into `dest`, refusing any member that escapes it."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if not _safe_member(info.filename):
                    raise StorageError(f"{uri}: archive member '{info.filename}' escapes the model folder")
                if (info.external_attr >> 16) & 0o170000 == 0o120000:
                    raise StorageError(f"{uri}: archive member '{info.filename}' is a symbolic link")
            zf.extractall(dest)
        return
    try:
        tf = tarfile.open(archive)
    except tarfile.TarError as exc:
        raise StorageError(f"{uri}: not a tar or zip archive ({exc})") from None
    with tf:
        for m in tf.getmembers():
            if not _safe_member(m.name):
                raise StorageError(f"{uri}: archive member '{m.name}' escapes the model folder")
            if m.issym() or m.islnk():
                target = PurePosixPath(m.name).parent / m.linkname if m.issym() else PurePosixPath(m.linkname)
                if not _safe_member(str(target)) or PurePosixPath(m.linkname).is_absolute():
                    raise StorageError(f"{uri}: archive member '{m.name}' links outside the model folder")
            elif not (m.isfile() or m.isdir()):
                raise StorageError(f"{uri}: archive member '{m.name}' is not a file or folder")
        tf.extractall(dest, filter="data")


class ArchiveModel(ModelSource):
    def __init__(self, repo: ArchiveRepository):
        self.repo, self.name, self.uri = repo, repo.name, repo.uri

    def versions(self) -> list[int]:
        return []  # known once fetched

    def config_text(self) -> str | None:
        return None

    def signature(self) -> tuple:
        return self.repo.validator

    def fetch(self) -> Path:
        repo = self.repo
        key = hashlib.sha256(repr((repo.uri, repo.validator)).encode()).hexdigest()[:16]
        final = repo.cache / key
        if (final / ".complete").is_file():
            return final / self.name
        repo.cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=repo.cache))
        try:
            archive = tmp / "archive"
            digest = self._download(archive)
            if repo.sha256 and digest != repo.sha256:
                raise StorageError(f"{repo.uri}: sha256 is {digest}, expected {repo.sha256}")
            unpacked = tmp / "unpacked"
            unpacked.mkdir()
            extract(archive, unpacked, repo.uri)
            archive.unlink()
            entries = [e for e in unpacked.iterdir() if not e.name.startswith(".")]
            inner = entries[0] if len(entries) == 1 and entries[0].is_dir() else unpacked
            if not (inner / "config.pbtxt").is_file() and not any(
                e.is_dir() and e.name.isdigit() for e in inner.iterdir()
            ):
                raise StorageError(f"{repo.uri}: the archive holds no config.pbtxt and no version folder")
            os.rename(inner, tmp / self.name)
            (tmp / ".complete").touch()
            shutil.rmtree(unpacked, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in repo.cache.iterdir():
            if old.name not in (final.name,) and not old.name.startswith(".tmp-"):
                shutil.rmtree(old, ignore_errors=True)
        return final / self.name

    def _download(self, path: Path) -> str:
        repo = self.repo
        digest = hashlib.sha256()
        started, done = time.monotonic(), 0
        try:
            with (
                urllib.request.urlopen(repo.url, timeout=TIMEOUT, context=_context()) as resp,
                open(path, "wb") as f,
            ):
                while chunk := resp.read(CHUNK):
                    f.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
        except urllib.error.HTTPError as exc:
            raise StorageError(f"{repo.uri}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise StorageError(f"{repo.uri}: {getattr(exc, 'reason', exc)}") from None
        log.info("fetched %s: %.1f MiB in %.1fs", repo.uri, done / 2**20, time.monotonic() - started)
        return digest.hexdigest()


class ArchiveRepository(RepositorySource):
    remote = True

    def __init__(self, uri: str, cache_root: Path):
        self.uri = uri
        parts = urlsplit(uri)
        if parts.scheme != "https":
            raise StorageError(f"model repository '{uri}': archives are fetched over https:// only")
        filename = PurePosixPath(parts.path).name
        suffix = next((s for s in SUFFIXES if filename.endswith(s)), None)
        if suffix is None or filename == suffix:
            raise StorageError(
                f"model repository '{uri}': expected a {', '.join(SUFFIXES)} archive of one model"
            )
        self.name = filename[: -len(suffix)]
        self.sha256 = ""
        if parts.fragment:
            algo, _, value = parts.fragment.partition("=")
            if algo != "sha256" or len(value) != 64:
                raise StorageError(f"model repository '{uri}': the fragment must be #sha256=<64 hex digits>")
            self.sha256 = value.lower()
        self.url = self.uri = parts._replace(fragment="").geturl()  # messages name the URL, not the checksum
        self.cache = Path(cache_root) / ("https-" + hashlib.sha256(self.url.encode()).hexdigest()[:16])
        self.validator: tuple = ()
        self._listed = False

    def refresh(self) -> None:
        """A HEAD request: the ETag (or Last-Modified and length) tells poll mode whether the archive changed."""
        request = urllib.request.Request(self.url, method="HEAD")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT, context=_context()) as resp:
                headers = resp.headers
        except urllib.error.HTTPError as exc:
            raise StorageError(f"{self.uri}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise StorageError(f"{self.uri}: {getattr(exc, 'reason', exc)}") from None
        self.validator = (
            headers.get("ETag", ""),
            headers.get("Last-Modified", ""),
            headers.get("Content-Length", ""),
            self.sha256,
        )
        self._listed = True

    def models(self) -> dict[str, ModelSource]:
        return {self.name: ArchiveModel(self)} if self._listed else {}
