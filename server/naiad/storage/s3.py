"""s3:// model repositories (Triton's URI syntax): list a bucket prefix and copy a model into a local cache.

`s3://bucket/path` uses the AWS SDK's own endpoint resolution (AWS_ENDPOINT_URL, profiles, regions);
`s3://host:port/bucket/path` and `s3://https://host:port/bucket/path` name an S3-compatible endpoint (http unless
said otherwise), as tritonserver reads them. Credentials, region, profiles, web-identity tokens and the CA bundle
(AWS_CA_BUNDLE) are botocore's. A model is copied into a temporary folder, object by object (large objects in
parallel parts, streamed to disk), and renamed into place only when every object arrived; objects whose ETag did
not change are linked from the previous copy instead of fetched again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

from .base import ModelSource, RepositorySource, StorageError

log = logging.getLogger("naiad.storage")

_URI = re.compile(
    r"^s3://(?:(?P<scheme>https?)://)?(?:(?P<host>[0-9A-Za-z.\-]+):(?P<port>[0-9]+)/)?"
    r"(?P<bucket>[^/]+)(?:/(?P<prefix>.*))?$"
)
MANIFEST = ".naiad-manifest.json"
PROGRESS_BYTES = 64 * 1024 * 1024  # models at least this large log their progress
PROGRESS_SECS = 2.0


def parse_uri(uri: str) -> tuple[str | None, str, str]:
    """(endpoint URL or None, bucket, key prefix without slashes at either end)."""
    m = _URI.match(uri)
    if m is None or not m.group("bucket"):
        raise StorageError(
            f"model repository '{uri}': not an S3 URI (expected s3://bucket/path or s3://[http(s)://]host:port/"
            "bucket/path)"
        )
    endpoint = None
    if m.group("host"):
        endpoint = f"{m.group('scheme') or 'http'}://{m.group('host')}:{m.group('port')}"
    return endpoint, m.group("bucket"), (m.group("prefix") or "").strip("/")


def describe(uri: str, exc: BaseException) -> str:
    """'<uri>: <cause>' in words an operator can act on."""
    from botocore import exceptions as bx

    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        cause = {
            "NoSuchBucket": "no such bucket",
            "AccessDenied": "access denied",
            "403": "access denied",
            "InvalidAccessKeyId": "access denied (the access key id is not known)",
            "SignatureDoesNotMatch": "access denied (the secret access key does not match)",
            "ExpiredToken": "access denied (the session token expired)",
            "NoSuchKey": "the object is gone (changed while it was being fetched)",
            "404": "not found",
            "PreconditionFailed": "the object changed while it was being fetched",
            "412": "the object changed while it was being fetched",
        }.get(code, f"{code or status}: {err.get('Message') or exc}")
        return f"{uri}: {cause}"
    if isinstance(exc, bx.NoCredentialsError):
        return f"{uri}: no credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or a web identity token)"
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
        return f"{uri}: cannot reach the S3 endpoint ({exc})"
    if isinstance(exc, bx.SSLError):
        return f"{uri}: TLS failure talking to the S3 endpoint ({exc}); AWS_CA_BUNDLE names a custom CA"
    if isinstance(exc, bx.BotoCoreError):
        return f"{uri}: {exc}"
    if isinstance(exc, OSError):
        return f"{uri}: {exc.strerror or exc}"
    return f"{uri}: {exc}"


class _Progress:
    """Logs bytes and rate every few seconds while a large model is fetched (callbacks come from many threads)."""

    def __init__(self, uri: str, total: int):
        self.uri, self.total, self.done = uri, total, 0
        self.started = self.last = time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self.lock:
            self.done += n
            now = time.monotonic()
            if self.total >= PROGRESS_BYTES and now - self.last >= PROGRESS_SECS:
                self.last = now
                self.log(now)

    def log(self, now: float | None = None, final: bool = False) -> None:
        elapsed = max((now or time.monotonic()) - self.started, 1e-6)
        log.info(
            "%s %s: %.1f of %.1f MiB (%.1f MiB/s)",
            "fetched" if final else "fetching",
            self.uri,
            self.done / 2**20,
            self.total / 2**20,
            self.done / 2**20 / elapsed,
        )


class S3Model(ModelSource):
    def __init__(self, repo: S3Repository, name: str, objects: dict[str, tuple[str, int]]):
        self.repo, self.name, self.objects = repo, name, objects  # relative key -> (etag, size)
        self.uri = f"{repo.uri.rstrip('/')}/{name}"

    def versions(self) -> list[int]:
        found = set()
        for rel in self.objects:
            head, sep, _ = rel.partition("/")
            if sep and head.isdigit() and not head.startswith("0"):
                found.add(int(head))
        return sorted(found)

    def config_text(self) -> str | None:
        if "config.pbtxt" not in self.objects:
            return None
        try:
            body = self.repo.client().get_object(
                Bucket=self.repo.bucket, Key=self.repo.key(self.name, "config.pbtxt")
            )
            return body["Body"].read(1 << 20).decode("utf-8", "replace")
        except Exception:
            return None  # the load reports the failure with its cause

    def signature(self) -> tuple:
        return tuple(sorted((rel, etag, size) for rel, (etag, size) in self.objects.items()))

    def fetch(self) -> Path:
        try:
            return self._fetch()
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(describe(self.uri, exc)) from None

    def _fetch(self) -> Path:
        if not self.objects:
            raise StorageError(f"{self.uri}: no such model (nothing under this prefix)")
        snapshot = hashlib.sha256(json.dumps(self.signature()).encode()).hexdigest()[:16]
        root = self.repo.cache / self.name
        final = root / snapshot
        if (final / MANIFEST).is_file():
            return final / self.name
        root.mkdir(parents=True, exist_ok=True)
        previous = self._previous_copies(root)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{snapshot}-", dir=root))
        try:
            model_dir = tmp / self.name
            total = sum(size for _, size in self.objects.values())
            progress = _Progress(self.uri, total)
            reused = fetched = 0
            for rel, (etag, size) in sorted(self.objects.items()):
                target = (model_dir / rel).resolve()
                if not str(target).startswith(str(model_dir.resolve()) + os.sep):
                    raise StorageError(f"{self.uri}: object key '{rel}' escapes the model directory")
                target.parent.mkdir(parents=True, exist_ok=True)
                if self._link_previous(previous, rel, etag, size, target):
                    reused += 1
                    progress(size)
                    continue
                self.repo.download(self.repo.key(self.name, rel), target, progress)
                if target.stat().st_size != size:
                    raise StorageError(
                        f"{self.uri}/{rel}: fetched {target.stat().st_size} bytes, the listing says {size}"
                    )
                fetched += 1
            (tmp / MANIFEST).write_text(json.dumps({rel: etag for rel, (etag, _) in self.objects.items()}))
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / MANIFEST).is_file():
                    raise
                # another server sharing the cache finished the same copy first
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if total >= PROGRESS_BYTES:
            progress.log(final=True)
        log.info("%s: %d object(s) fetched, %d unchanged (ETag) reused", self.uri, fetched, reused)
        self._prune(root, keep={final.name} | {p.name for p in previous[:1]})
        return final / self.name

    @staticmethod
    def _previous_copies(root: Path) -> list[Path]:
        copies = [p for p in root.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file()]
        return sorted(copies, key=lambda p: p.stat().st_mtime, reverse=True)

    def _link_previous(self, previous: list[Path], rel: str, etag: str, size: int, target: Path) -> bool:
        for copy in previous:
            try:
                manifest = json.loads((copy / MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            source = copy / self.name / rel
            if manifest.get(rel) == etag and source.is_file() and source.stat().st_size == size:
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copyfile(source, target)
                return True
        return False

    @staticmethod
    def _prune(root: Path, keep: set[str]) -> None:
        """Older copies go; the newest previous one stays (a loaded model may still read its files)."""
        for p in root.iterdir():
            if p.name not in keep and not p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)


class S3Repository(RepositorySource):
    remote = True

    def __init__(self, uri: str, cache_root: Path):
        self.uri = uri
        self.endpoint, self.bucket, self.prefix = parse_uri(uri)
        self.cache = Path(cache_root) / ("s3-" + hashlib.sha256(uri.encode()).hexdigest()[:16])
        self._client = None
        self._client_lock = threading.Lock()
        self._models: dict[str, ModelSource] = {}

    def client(self):
        with self._client_lock:
            if self._client is None:
                try:
                    import boto3
                    from botocore.config import Config
                except ImportError:
                    raise StorageError(
                        f"{self.uri}: s3:// repositories need boto3 (pip install 'naiad[s3]')"
                    ) from None
                session = boto3.session.Session()
                config = Config(
                    retries={"max_attempts": 3, "mode": "standard"},
                    connect_timeout=10,
                    read_timeout=60,
                    s3={"addressing_style": "path"} if self.endpoint else {},
                )
                self._client = session.client(
                    "s3",
                    endpoint_url=self.endpoint,
                    region_name=session.region_name or "us-east-1",
                    config=config,
                )
            return self._client

    def key(self, name: str, rel: str) -> str:
        return "/".join(p for p in (self.prefix, name, rel) if p)

    def refresh(self) -> None:
        start = f"{self.prefix}/" if self.prefix else ""
        grouped: dict[str, dict[str, tuple[str, int]]] = {}
        try:
            pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start)
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(start) :]
                    name, sep, inner = rel.partition("/")
                    if not sep or not name or name.startswith(".") or not inner or inner.endswith("/"):
                        continue
                    grouped.setdefault(name, {})[inner] = (obj.get("ETag", "").strip('"'), int(obj["Size"]))
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(describe(self.uri, exc)) from None
        self._models = {name: S3Model(self, name, objs) for name, objs in sorted(grouped.items())}

    def models(self) -> dict[str, ModelSource]:
        return dict(self._models)

    def download(self, key: str, target: Path, progress) -> None:
        """One object to `target`, streamed to disk; parts in parallel above 16 MiB (s3transfer pins the parts to
        the ETag it saw first, so an object replaced mid-download fails instead of mixing)."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_threshold=16 * 2**20,
            multipart_chunksize=16 * 2**20,
            max_concurrency=8,
            use_threads=True,
        )
        self.client().download_file(self.bucket, key, str(target), Callback=progress, Config=config)
