"""Turns what a user sends as an image (data URL, http(s) URL, local file, bytes, PIL image) into a PIL image.

Deployments are often offline and servers are shared, so remote fetching is off unless asked for, local
files are readable only under one configured folder, and every failure is an `ImageError` whose message
names the problem (the server answers it with a 400).
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageError(ValueError):
    """A bad image input; the message says what is wrong with it."""


@dataclass(frozen=True)
class MediaPolicy:
    allow_remote: bool = False  # fetch http(s) URLs
    allowed_local_path: Path | None = None  # file:// URLs and plain paths only under this folder
    max_bytes: int = 20 * 1024**2  # of one encoded image, remote or inline
    timeout_s: float = 10.0  # of one remote fetch
    max_pixels: int = 64 * 1024**2  # width x height of one decoded image

    def load(self, source: object) -> Image.Image:
        """An RGB image from a PIL image, bytes, a data:/http(s)://file:// URL or a local path."""
        if isinstance(source, Image.Image):
            return self._checked(source)
        if isinstance(source, (bytes, bytearray)):
            return self.decode(bytes(source))
        if not isinstance(source, str):
            raise ImageError(f"an image must be a URL, a path, bytes or a PIL image, not {type(source).__name__}")
        if source.startswith("data:"):
            return self.decode(_data_url_bytes(source))
        if source.startswith(("http://", "https://")):
            return self.decode(self._fetch(source))
        if source.startswith("file://"):
            source = source.removeprefix("file://")
        elif "://" in source:
            raise ImageError(f"unsupported image URL scheme in {source[:40]!r}: use data:, http(s):// or file://")
        return self.decode(self._read_local(Path(source)))

    def decode(self, data: bytes) -> Image.Image:
        if len(data) > self.max_bytes:
            raise ImageError(f"the image is {len(data)} bytes, more than the limit of {self.max_bytes}")
        try:
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError as exc:
            raise ImageError("cannot decode the image: not a PNG, JPEG, WebP or GIF file") from exc
        if image.format not in SUPPORTED_FORMATS:
            raise ImageError(f"unsupported image format {image.format}; supported: {', '.join(SUPPORTED_FORMATS)}")
        self._check_size(image)
        try:
            image.seek(0)  # a GIF's first frame
            image.load()
        except (OSError, SyntaxError, ValueError) as exc:
            raise ImageError(f"cannot decode the {image.format} image: {exc}") from exc
        return self._checked(image)

    def _checked(self, image: Image.Image) -> Image.Image:
        self._check_size(image)
        return image if image.mode == "RGB" else image.convert("RGB")

    def _check_size(self, image: Image.Image) -> None:
        width, height = image.size
        if width * height > self.max_pixels:
            raise ImageError(f"the image has {width}x{height} pixels, more than the limit of {self.max_pixels}")
        if width < 1 or height < 1:
            raise ImageError(f"the image is empty ({width}x{height})")

    def _fetch(self, url: str) -> bytes:
        if not self.allow_remote:
            raise ImageError("remote image URLs are disabled on this server (start it with --allow-remote-media)")
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:  # noqa: S310 - http(s) only
                data = response.read(self.max_bytes + 1)
        except OSError as exc:
            raise ImageError(f"cannot fetch the image from {url}: {exc}") from exc
        if len(data) > self.max_bytes:
            raise ImageError(f"the image at {url} is larger than the limit of {self.max_bytes} bytes")
        return data

    def _read_local(self, path: Path) -> bytes:
        if self.allowed_local_path is None:
            raise ImageError("local image files are disabled (allow a folder with --allowed-local-media-path)")
        root = self.allowed_local_path.resolve()
        resolved = path.resolve()
        if not resolved.is_relative_to(root):
            raise ImageError(f"{path} is outside the allowed local media path {root}")
        if not resolved.is_file():
            raise ImageError(f"no image file at {path}")
        if resolved.stat().st_size > self.max_bytes:
            raise ImageError(f"{path} is larger than the limit of {self.max_bytes} bytes")
        return resolved.read_bytes()


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError("a data URL image must look like data:image/png;base64,<data>")
    media_type = header.removeprefix("data:").removesuffix(";base64")
    if media_type and not media_type.startswith("image/"):
        raise ImageError(f"the data URL has media type {media_type!r}, not an image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the data URL's base64 payload is invalid: {exc}") from exc
