"""Turns what a user sends as an image (data URL, http(s) URL, local file, bytes, PIL image) into a PIL image.

Deployments are often offline and servers are shared, so remote fetching is off unless asked for (and then
reaches only public addresses or the hosts the operator names, `fetch.py`), local files are readable only
under one configured folder, and pixels are bounded per image and per request before anything is decoded:
a few hundred bytes of PNG can claim a billion pixels. Every failure is an `ImageError` whose message names
the problem (the server answers it with a 400).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from heteroserve.config import MultimodalConfig
from heteroserve.multimodal.fetch import FetchError, fetch, normalized_host

logger = logging.getLogger(__name__)

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageError(ValueError):
    """A bad image input; the message says what is wrong with it."""


@dataclass(frozen=True)
class MediaPolicy:
    allow_remote: bool = False  # fetch http(s) URLs
    allowed_domains: frozenset[str] | None = None  # the only remote hosts, on any address; None: any public host
    allowed_local_path: Path | None = None  # file:// URLs and plain paths only under this folder
    max_bytes: int = 20 * 1024**2  # of one encoded image, remote or inline
    timeout_s: float = 10.0  # of one remote fetch, all of it: resolution, redirects, body
    max_pixels: int = 64 * 1024**2  # width x height of one decoded image
    max_request_pixels: int = 128 * 1024**2  # of all of one request's decoded images together
    max_images: int = 8  # in one request, counted before any is fetched or decoded

    def __post_init__(self) -> None:
        # Pillow refuses (or, with warnings as errors, raises on) images above its own limit when opening them,
        # so a larger limit of ours could never take effect.
        if Image.MAX_IMAGE_PIXELS is not None and self.max_pixels > Image.MAX_IMAGE_PIXELS:
            raise ValueError(
                f"the image pixel limit {self.max_pixels} is above Pillow's decompression-bomb limit "
                f"{Image.MAX_IMAGE_PIXELS}"
            )
        for host in self.allowed_domains or ():
            try:
                normalized_host(host)
            except UnicodeError as exc:
                raise ValueError(f"{host!r} in the allowed media domains is not a host name: {exc}") from exc

    @classmethod
    def from_config(cls, config: MultimodalConfig, **settings: object) -> MediaPolicy:
        """The engine's image limits from `config`; `settings`: where images may come from (the server's flags)."""
        return cls(
            max_pixels=config.max_image_pixels,
            max_request_pixels=config.max_request_image_pixels,
            max_images=config.limit_images_per_prompt,
            **settings,
        )

    def load_images(self, sources: Sequence[object]) -> list[Image.Image]:
        """One request's images as RGB images, from PIL images, bytes, data:/http(s)://file:// URLs or local paths.

        Each image's size is read from its header and added to the request's total before it is decoded, so a
        request never holds more than `max_request_pixels` decoded pixels."""
        if len(sources) > self.max_images:
            raise ImageError(
                f"the prompt has {len(sources)} images, more than the limit of {self.max_images} per prompt"
            )
        images: list[Image.Image] = []
        total = 0
        for source in sources:
            image = self._open(source)
            total += image.width * image.height
            if total > self.max_request_pixels:
                raise ImageError(
                    f"the request's images have {total} pixels in all (up to image {len(images) + 1}), more than "
                    f"the limit of {self.max_request_pixels} per request"
                )
            images.append(self._decoded(image))
        return images

    def _open(self, source: object) -> Image.Image:
        """`source` as a PIL image of checked size; an encoded one has only its header read, nothing decoded."""
        if isinstance(source, Image.Image):
            image = source
        elif isinstance(source, (bytes, bytearray)):
            image = self._open_encoded(bytes(source))
        elif not isinstance(source, str):
            raise ImageError(f"an image must be a URL, a path, bytes or a PIL image, not {type(source).__name__}")
        elif source.startswith("data:"):
            image = self._open_encoded(_data_url_bytes(source))
        elif source.startswith(("http://", "https://")):
            image = self._open_encoded(self._fetch(source))
        elif source.startswith("file://"):
            image = self._open_encoded(self._read_local(Path(source.removeprefix("file://"))))
        elif "://" in source:
            raise ImageError(f"unsupported image URL scheme in {source[:40]!r}: use data:, http(s):// or file://")
        else:
            image = self._open_encoded(self._read_local(Path(source)))
        width, height = image.size
        if width * height > self.max_pixels:
            raise ImageError(f"the image has {width}x{height} pixels, more than the limit of {self.max_pixels}")
        if width < 1 or height < 1:
            raise ImageError(f"the image is empty ({width}x{height})")
        return image

    def _open_encoded(self, data: bytes) -> Image.Image:
        if len(data) > self.max_bytes:
            raise ImageError(f"the image is {len(data)} bytes, more than the limit of {self.max_bytes}")
        try:
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError as exc:
            raise ImageError("cannot decode the image: not a PNG, JPEG, WebP or GIF file") from exc
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageError(self._bomb_message()) from exc
        except (OSError, SyntaxError, ValueError) as exc:
            raise ImageError(f"cannot decode the image: {exc}") from exc
        if image.format not in SUPPORTED_FORMATS:
            raise ImageError(f"unsupported image format {image.format}; supported: {', '.join(SUPPORTED_FORMATS)}")
        return image

    def _decoded(self, image: Image.Image) -> Image.Image:
        try:
            image.seek(0)  # a GIF's first frame
            image.load()
            return image if image.mode == "RGB" else image.convert("RGB")
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # a GIF frame past its header
            raise ImageError(self._bomb_message()) from exc
        except (OSError, SyntaxError, ValueError) as exc:
            raise ImageError(f"cannot decode the {image.format or image.mode} image: {exc}") from exc

    def _bomb_message(self) -> str:
        """Pillow refused the image before we saw its size: it has more than Pillow's limit, and so than ours."""
        return f"the image has more than {Image.MAX_IMAGE_PIXELS} pixels, more than the limit of {self.max_pixels}"

    def _fetch(self, url: str) -> bytes:
        if not self.allow_remote:
            raise ImageError("remote image URLs are disabled on this server (start it with --allow-remote-media)")
        try:
            return fetch(url, self.timeout_s, self.max_bytes, self.allowed_domains)
        except FetchError as exc:
            # The reason (what answered, or did not) stays in the log: telling the client would map the network.
            logger.info("image fetch of %s refused: %s", url, exc)
            shown = url if len(url) <= 200 else url[:200] + "..."
            raise ImageError(f"the image at {shown} could not be fetched") from exc

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
