"""Images an LLM request carries: how they travel (Triton vllm_backend's `image` input: one base64 string per image,
in the order the prompt places them), the limits every image and request is held to, and decoding them safely.

The limits (`--max-image-bytes`, `--max-image-pixels`, `--max-images-per-request`) are checked twice: by the LLM
APIs before a request is sent (a 400 in that API's error object) and by the engines that take images, for requests
that come straight from Triton's generate endpoints or gRPC. An image is opened by Pillow only as PNG, JPEG, WebP or
GIF (OpenAI's formats; a GIF's first frame), and its size is read from its header before any pixel is decoded: an
image of more pixels than the limit (a decompression bomb: a few KB of PNG that inflate to gigabytes) is refused
undecoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgument

INPUT = "image"  # the input tensor's name (Triton vllm_backend's): TYPE_STRING, dims [-1], base64 strings
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DEFAULT_MAX_BYTES = 20 * 1024 * 1024  # OpenAI's limit per image
DEFAULT_MAX_PIXELS = 33_554_432  # 32 Mpx (8192 x 4096): a 24 Mpx camera's photo fits, 96 MiB of RGB at most
DEFAULT_MAX_IMAGES = 8


@dataclass
class ImageLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES


limits = ImageLimits()


def configure(max_bytes: int, max_pixels: int, max_images: int) -> None:
    """The process's limits (`naiad serve`'s flags, in the engine and in every frontend worker)."""
    for flag, value in (
        ("--max-image-bytes", max_bytes),
        ("--max-image-pixels", max_pixels),
        ("--max-images-per-request", max_images),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be positive, got {value}")
    limits.max_bytes, limits.max_pixels, limits.max_images = max_bytes, max_pixels, max_images


@dataclass(frozen=True)
class ImageInfo:
    format: str
    width: int
    height: int


def check_count(n: int) -> None:
    if n > limits.max_images:
        raise InvalidArgument(
            f"the request has {n} images, more than the {limits.max_images} one request may carry "
            "(--max-images-per-request)"
        )


def check_size(n_bytes: int, what: str = "an image") -> None:
    if n_bytes > limits.max_bytes:
        raise InvalidArgument(
            f"{what} has {n_bytes} bytes, more than the {limits.max_bytes} an image may have (--max-image-bytes)"
        )


def decode_base64(text: str | bytes, what: str = "an image") -> bytes:
    """The bytes of base64 text (standard alphabet, padded; ASCII whitespace is ignored); InvalidArgument for text
    that is not base64 or decodes to more than the byte limit (checked before decoding)."""
    if isinstance(text, str):
        try:
            raw = text.encode("ascii")
        except UnicodeEncodeError:
            raise InvalidArgument(f"{what} is not valid base64 (it has non-ASCII characters)") from None
    else:
        raw = bytes(text)
    raw = b"".join(raw.split())
    check_size(len(raw) // 4 * 3, what)
    if not raw:
        raise InvalidArgument(f"{what} is empty")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"{what} is not valid base64 ({exc})") from None


def _open(data: bytes, what: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    check_size(len(data), what)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise InvalidArgument(
            f"{what} has more pixels than the {limits.max_pixels} an image may have (--max-image-pixels)"
        ) from None
    except UnidentifiedImageError:
        raise InvalidArgument(
            f"{what} is not an image in a supported format ({', '.join(FORMATS)})"
        ) from None
    except (
        Exception
    ) as exc:  # Pillow's plugins raise what their parsers meet (SyntaxError, struct.error, ...)
        raise InvalidArgument(f"{what} cannot be read as an image: {type(exc).__name__}: {exc}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidArgument(f"{what} has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        raise InvalidArgument(
            f"{what} is {width}x{height} = {width * height} pixels, more than the {limits.max_pixels} an image may "
            "have (--max-image-pixels)"
        )
    return image


def probe(data: bytes, what: str = "an image") -> ImageInfo:
    """The format and size of an image from its header (no pixel decoded); InvalidArgument for one past the limits,
    in another format, or not an image."""
    image = _open(data, what)
    return ImageInfo(image.format or "?", *image.size)


def decode(data: bytes, what: str = "an image") -> Any:
    """The image as a Pillow RGB image (a GIF's first frame; transparency dropped, as vllm_backend's
    `.convert("RGB")` does); InvalidArgument for one past the limits or that does not decode."""
    image = _open(data, what)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image.seek(0)
            image.load()
            return image.convert("RGB")
    except Exception as exc:
        raise InvalidArgument(f"{what} could not be decoded: {type(exc).__name__}: {exc}") from None


def encode_values(images: list[bytes]) -> list[bytes]:
    """The `image` tensor's elements for raw images: base64 text (what Triton's vllm_backend reads)."""
    return [base64.b64encode(data) for data in images]


def from_request(inputs: dict[str, np.ndarray]) -> list[bytes]:
    """The images of a request's `image` input (base64 strings, as vllm_backend takes them) as bytes, count and size
    checked; [] when it has none."""
    tensor = inputs.get(INPUT)
    if tensor is None or tensor.size == 0:
        return []
    values = tensor.reshape(-1)
    check_count(len(values))
    out = []
    for i, value in enumerate(values):
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, (bytes, str)):
            raise InvalidArgument(f"input '{INPUT}' element {i} must be a base64 string")
        out.append(decode_base64(value, f"input '{INPUT}' element {i}"))
    return out
