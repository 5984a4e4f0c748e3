"""Client images, checked before anything decodes them in full: a PIL image (the offline API, vLLM's
``multi_modal_data``), raw bytes, a ``data:`` URL (the HTTP APIs), or an http(s) URL where the operator
allows its domain (``media_fetch``). Every refusal is an
``InvalidRequestError`` naming the limit: oversize bytes, more pixels than allowed (read from the header,
before the pixels are: decompression bombs), a format that is not an image one, truncated or corrupt data."""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from typing import Any

from cb_serve.errors import InvalidRequestError
from cb_serve.multimodal.media_fetch import fetch_image

DEFAULT_MAX_IMAGES = 8  # per prompt, where limit_mm_per_prompt does not say
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what PIL decodes without plugins, as image/<format>
DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


@dataclass(frozen=True)
class ImageLimits:
    """What one prompt's images may be (engine arguments ``limit_mm_per_prompt``, ``max_image_bytes``,
    ``max_image_pixels``, ``allowed_media_domains``)."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_bytes: int = 20 << 20  # encoded
    max_pixels: int = 36_000_000  # width * height (a 6000 x 6000 photo)
    allowed_domains: tuple[str, ...] = ()  # http(s) URLs from these (media_fetch.py); none: data URLs only

    @staticmethod
    def of(config) -> ImageLimits:
        """The limits an ``EngineConfig`` sets."""
        limit = config.image_limit()
        return ImageLimits(DEFAULT_MAX_IMAGES if limit is None else limit, config.max_image_bytes,
                           config.max_image_pixels, tuple(config.allowed_media_domains or ()))  # fmt: skip

    def __post_init__(self) -> None:
        assert self.max_images >= 0 and self.max_bytes > 0 and self.max_pixels > 0, self


def load_images(images: Any, limits: ImageLimits, param: str = "multi_modal_data") -> list:
    """The RGB PIL images of one prompt's ``images`` (one image or a list of them)."""
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if len(items) > limits.max_images:
        raise InvalidRequestError(
            f"At most {limits.max_images} images per prompt are allowed (limit_mm_per_prompt), got {len(items)}.",
            param,
        )
    return [load_image(item, limits, param) for item in items]


def load_image(source: Any, limits: ImageLimits, param: str = "multi_modal_data"):
    """One image, decoded and converted to RGB, within ``limits``."""
    from PIL import Image

    if isinstance(source, Image.Image):
        check_pixels(source.size, limits, param)
        return source.convert("RGB")
    if isinstance(source, str) and source.split(":", 1)[0].lower() in ("http", "https"):
        source = fetch_image(source, limits.allowed_domains, limits.max_bytes, param)
    elif isinstance(source, str):
        source = decode_data_url(source, limits, param)
    if not isinstance(source, (bytes, bytearray, memoryview)):
        raise InvalidRequestError(f"An image is a PIL image, bytes or a data: URL, got {type(source).__name__}.", param)
    data = bytes(source)
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(f"An image is limited to {limits.max_bytes} bytes, got {len(data)}.", param)
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:  # reads the header only
            check_pixels(image.size, limits, param)
            image.load()
            return image.convert("RGB")
    except InvalidRequestError:
        raise
    except Image.DecompressionBombError as e:
        raise InvalidRequestError(f"The image has too many pixels: {e}", param) from e
    except (OSError, SyntaxError, ValueError) as e:  # unidentified, truncated or corrupt
        raise InvalidRequestError(f"The image could not be decoded ({type(e).__name__}: {e}).", param) from e


def check_pixels(size: tuple[int, int], limits: ImageLimits, param: str) -> None:
    width, height = size
    if width <= 0 or height <= 0 or width * height > limits.max_pixels:
        raise InvalidRequestError(
            f"An image is limited to {limits.max_pixels} pixels, got {width} x {height} (max_image_pixels).", param
        )


def decode_data_url(url: str, limits: ImageLimits, param: str) -> bytes:
    """The bytes of a base64 ``data:image/...`` URL; any other scheme is refused."""
    match = DATA_URL.match(url)
    if match is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "(none)"
        raise InvalidRequestError(f"An image URL is a data: URL (or http(s) where the server allows its domain), "
                                  f"got the scheme {scheme!r}.", param)  # fmt: skip
    mime = (match["mime"] or "").lower()
    if not mime.startswith("image/") or mime[len("image/") :].upper().replace("JPG", "JPEG") not in FORMATS:
        raise InvalidRequestError(f"The data URL's type {mime or '(none)'!r} is not an image type this server reads "
                                  f"({', '.join('image/' + f.lower() for f in FORMATS)}).", param)  # fmt: skip
    if not match["b64"]:
        raise InvalidRequestError("An image data URL must be base64 (data:image/png;base64,...).", param)
    payload = url[match.end() :]
    if len(payload) > 4 * (limits.max_bytes // 3 + 1) + 4:
        raise InvalidRequestError(f"An image is limited to {limits.max_bytes} bytes.", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"The image data URL is not valid base64: {e}", param) from e
