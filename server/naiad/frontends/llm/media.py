"""Images in chat messages, as every LLM API reads them: where they come from and how the chat template sees them.

Each API's parser turns its image parts (OpenAI's `image_url`, the Responses API's `input_image`, Anthropic's `image`
blocks) into one content part, `{"type": "image", "image_url": <url>}`, kept in the message's content list beside
its text parts (`{"type": "text", "text": ...}`); a message without images keeps its text as one string, as before.
Before the prompt is rendered, `MediaLoader` reads each image's bytes from its URL: a `data:` URL (base64), a
`file:` URL under `--allowed-local-media-path`, an `http(s):` URL only with `--allow-image-fetch` (bounded in size
and time). `for_template` then gives the chat template what the model expects (llm/info.py's IMAGES): llama.cpp's
marker text where each image goes (joined as llama-server joins content parts), or `{"type": "image"}` parts for a
Hugging Face template, which writes the model's own image token. The images travel to the model as its `image`
input (mapping.py), in the order the rendered prompt places them.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import InvalidArgument
from ...llm import images
from .errors import LLMError

IMAGE = "image"
DEFAULT_FETCH_TIMEOUT_S = 10.0


def image_part(url: Any, where: str, param: str | None = None) -> dict:
    """The content part of an image at `url` (checked to be a non-empty string)."""
    if not isinstance(url, str) or not url:
        raise LLMError(f"'{where}' needs an image URL (a data: URL with the image in base64)", param=param)
    return {"type": IMAGE, "image_url": url}


def content(texts_and_images: list[dict]) -> str | list[dict]:
    """A message's content from its text and image parts: the text joined by newlines (as ever) when it has no
    image, else the parts themselves."""
    if any(p.get("type") == IMAGE for p in texts_and_images):
        return texts_and_images
    return "\n".join(p["text"] for p in texts_and_images)


def image_urls(messages: list[dict] | None) -> list[str]:
    """The URLs of the images in `messages`, in order."""
    out: list[str] = []
    for msg in messages or []:
        parts = msg.get("content")
        if isinstance(parts, list):
            out.extend(p["image_url"] for p in parts if isinstance(p, dict) and p.get("type") == IMAGE)
    return out


def text_size(messages: list[dict] | None) -> int:
    """The characters of text in `messages` (what rendering them costs)."""
    size = 0
    for msg in messages or []:
        parts = msg.get("content")
        if isinstance(parts, str):
            size += len(parts)
        elif isinstance(parts, list):
            size += sum(len(p.get("text") or "") for p in parts if isinstance(p, dict))
    return size


def for_template(messages: list[dict], marker: str | None) -> list[dict]:
    """`messages` as the chat template takes them. With a `marker` (llama.cpp's), a content list becomes text in which
    the marker stands for each image, the text parts joined by newlines but none put before or after a marker, as
    llama-server joins them. Without one (a Hugging Face template), when any message has an image every message's
    content is a list of `{"type": "text", "text": ...}` and `{"type": "image"}` parts (a template for images
    iterates over content parts)."""
    if not image_urls(messages):
        return messages
    out = []
    for msg in messages:
        parts = msg.get("content")
        if marker is not None:
            if isinstance(parts, list):
                msg = {**msg, "content": _joined(parts, marker)}
        elif isinstance(parts, list):
            msg = {**msg, "content": [{"type": IMAGE} if p.get("type") == IMAGE else p for p in parts]}
        else:
            msg = {**msg, "content": [{"type": "text", "text": parts}] if parts else []}
        out.append(msg)
    return out


def _joined(parts: list[dict], marker: str) -> str:
    text = ""
    after_marker = False
    for part in parts:
        if part.get("type") == IMAGE:
            text += marker
            after_marker = True
            continue
        if text and not after_marker:
            text += "\n"
        text += part.get("text") or ""
        after_marker = False
    return text


@dataclass
class MediaSettings:
    """Where images may come from besides data: URLs (`naiad serve`'s flags)."""

    allowed_local_media_path: str | None = None  # file: URLs under this folder are read
    allow_fetch: bool = False  # http(s): URLs are fetched
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S


class MediaLoader:
    """An image's bytes from its URL, within the size limit, checked to be an image of the supported formats and
    pixels (its header; the engine decodes it)."""

    def __init__(self, settings: MediaSettings | None = None):
        self.settings = settings or MediaSettings()
        folder = self.settings.allowed_local_media_path
        self.folder = Path(folder).resolve() if folder else None

    async def load_all(self, urls: list[str], param: str | None) -> list[bytes]:
        try:
            images.check_count(len(urls))
        except InvalidArgument as exc:
            raise LLMError(exc.message, param=param) from None
        out = []
        for i, url in enumerate(urls):
            what = f"image {i + 1}" if len(urls) > 1 else "the image"
            try:
                data = await self.load(url, what)
                images.probe(data, what)
            except InvalidArgument as exc:
                raise LLMError(exc.message, param=param) from None
            out.append(data)
        return out

    async def load(self, url: str, what: str = "the image") -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return _data_url(url, what)
        if scheme == "file":
            return await asyncio.to_thread(self._file, url, what)
        if scheme in ("http", "https"):
            if not self.settings.allow_fetch:
                raise InvalidArgument(
                    f"{what} is at a remote URL, which this server does not fetch: send it as a data: URL "
                    "(data:image/png;base64,...), or start the server with --allow-image-fetch"
                )
            return await self._fetch(url, what)
        raise InvalidArgument(
            f"{what} has a URL of scheme {scheme or 'none'!r}: give a data: URL (data:image/png;base64,...)"
        )

    def _file(self, url: str, what: str) -> bytes:
        if self.folder is None:
            raise InvalidArgument(
                f"{what} is a file: URL, which this server does not read: send it as a data: URL, or start the "
                "server with --allowed-local-media-path DIR"
            )
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise InvalidArgument(f"{what}: a file: URL must name a local file (file:///path), not a host")
        path = Path(urllib.parse.unquote(parts.path))
        if not path.is_absolute():
            raise InvalidArgument(f"{what}: a file: URL must hold an absolute path (file:///path)")
        try:
            real = path.resolve(strict=True)  # symbolic links followed: where the file really is
        except (OSError, RuntimeError, ValueError):  # (ValueError: a NUL byte in the path)
            raise InvalidArgument(f"{what}: no file at {path}") from None
        if not real.is_relative_to(self.folder):
            raise InvalidArgument(
                f"{what}: {path} is not under the allowed media folder (--allowed-local-media-path)"
            )
        if not real.is_file():  # not a folder, a FIFO or a device (a read that would block or never end)
            raise InvalidArgument(f"{what}: {path} is not a regular file")
        limit = images.limits.max_bytes
        try:
            with open(real, "rb") as f:
                data = f.read(limit + 1)
        except OSError as exc:
            raise InvalidArgument(f"{what}: {path} cannot be read ({exc.strerror or exc})") from None
        images.check_size(len(data), what)
        return data

    async def _fetch(self, url: str, what: str) -> bytes:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.settings.fetch_timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.get(url, max_redirects=3) as resp:
                    if resp.status != 200:
                        raise InvalidArgument(f"{what}: fetching {url} answered HTTP {resp.status}")
                    if resp.content_length is not None:
                        images.check_size(resp.content_length, what)
                    data = bytearray()
                    async for chunk in resp.content.iter_chunked(65536):
                        data += chunk
                        images.check_size(len(data), what)
                    return bytes(data)
        except TimeoutError:
            raise InvalidArgument(
                f"{what}: fetching {url} took more than {self.settings.fetch_timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as exc:
            raise InvalidArgument(f"{what}: fetching {url} failed: {type(exc).__name__}: {exc}") from None


def _data_url(url: str, what: str) -> bytes:
    """The bytes of `data:<media type>;base64,<data>`."""
    head, sep, body = url.partition(",")
    if not sep:
        raise InvalidArgument(
            f"{what}: a data: URL needs a comma before its data (data:image/png;base64,...)"
        )
    params = [p.strip().lower() for p in head[5:].split(";")]
    if "base64" not in params[1:]:
        raise InvalidArgument(f"{what}: only base64 data: URLs are taken (data:image/png;base64,...)")
    if params[0] and not params[0].startswith("image/"):
        raise InvalidArgument(f"{what}: a data: URL of type {params[0]!r} is not an image")
    return images.decode_base64(body, what)


def media_settings_from_args(args: Any) -> MediaSettings:
    """`naiad serve`'s image flags (--allowed-local-media-path, --allow-image-fetch, --image-fetch-timeout-secs)."""
    return MediaSettings(
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
        allow_fetch=getattr(args, "allow_image_fetch", False),
        fetch_timeout_s=getattr(args, "image_fetch_timeout_secs", DEFAULT_FETCH_TIMEOUT_S),
    )
