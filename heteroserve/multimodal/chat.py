"""OpenAI-style chat messages with image parts -> messages for the chat template, plus the images in order.

An image part (`{"type": "image_url", "image_url": {"url": ...}}`, or `{"type": "image", "image": ...}`)
becomes `{"type": "image"}`, which Qwen-VL chat templates render as the image's placeholder tokens. Text
parts of a message without images are joined into a plain string, as text-only templates expect.
"""

from __future__ import annotations

from collections.abc import Mapping

from PIL import Image

from heteroserve.multimodal.media import ImageError, MediaPolicy

Message = Mapping[str, object]


def split_images(messages: list[Message], policy: MediaPolicy) -> tuple[list[dict], list[Image.Image]]:
    """The messages with each image part as `{"type": "image"}`, and the images, loaded together so that the
    policy's per-request limits (image count, total pixels) cover them all."""
    rendered: list[dict] = []
    sources: list[object] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(dict(message))
            continue
        parts: list[dict] = []
        for part in content:
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in ("image_url", "image"):
                sources.append(_image_source(part))
                parts.append({"type": "image"})
            else:
                raise ImageError(f"unsupported content part type {kind!r}; supported: text, image_url")
        if any(p["type"] == "image" for p in parts):
            rendered.append({**message, "content": parts})
        else:
            rendered.append({**message, "content": "".join(p["text"] for p in parts)})
    return rendered, policy.load_images(sources)


def _image_source(part: Mapping[str, object]) -> object:
    if part.get("type") == "image":
        return part.get("image")
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not url:
        raise ImageError("an image_url part needs image_url.url")
    return url
