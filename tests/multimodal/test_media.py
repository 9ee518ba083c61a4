"""MediaPolicy against a real HTTP server on 127.0.0.1 and real files: fetching, limits, and refusals."""

from __future__ import annotations

import io
import logging
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from heteroserve.multimodal.media import ImageError, MediaPolicy


def png_bytes(seed: int = 0, size: int = 40) -> tuple[bytes, Image.Image]:
    picture = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue(), picture


@pytest.fixture(scope="module")
def http_server():
    body, _ = png_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/slow.png":
                time.sleep(2)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_fetch_when_allowed(http_server):
    _, picture = png_bytes()
    loaded = MediaPolicy(allow_remote=True, allowed_domains=frozenset({"127.0.0.1"}))
    assert np.array_equal(np.asarray(loaded.load_images([f"{http_server}/cat.png"])[0]), np.asarray(picture))
    with pytest.raises(ImageError, match="remote image URLs are disabled"):
        MediaPolicy().load_images([f"{http_server}/cat.png"])
    with pytest.raises(ImageError, match="could not be fetched"):  # loopback is not public
        MediaPolicy(allow_remote=True).load_images([f"{http_server}/cat.png"])


def test_remote_size_limit_and_timeout_say_why_only_in_the_log(http_server, caplog):
    local = {"allow_remote": True, "allowed_domains": frozenset({"127.0.0.1"})}
    with caplog.at_level(logging.INFO), pytest.raises(ImageError, match="^the image at .* could not be fetched$"):
        MediaPolicy(**local, max_bytes=100).load_images([f"{http_server}/cat.png"])
    assert "larger than the limit of 100 bytes" in caplog.text
    with caplog.at_level(logging.INFO), pytest.raises(ImageError, match="^the image at .* could not be fetched$"):
        MediaPolicy(**local, timeout_s=0.3).load_images([f"{http_server}/slow.png"])
    assert "deadline" in caplog.text


def test_local_files_only_under_the_allowed_folder(tmp_path):
    body, picture = png_bytes(1)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(body)
    (tmp_path / "secret.png").write_bytes(body)
    (allowed / "escape.png").symlink_to(tmp_path / "secret.png")
    policy = MediaPolicy(allowed_local_path=allowed)
    assert np.array_equal(np.asarray(policy.load_images([f"file://{allowed / 'ok.png'}"])[0]), np.asarray(picture))
    for outside in (tmp_path / "secret.png", allowed / "escape.png", allowed / ".." / "secret.png"):
        with pytest.raises(ImageError, match="outside the allowed local media path"):
            policy.load_images([str(outside)])
    with pytest.raises(ImageError, match="local image files are disabled"):
        MediaPolicy().load_images([str(allowed / "ok.png")])


def test_pixel_limit_is_checked_before_decoding():
    big = Image.new("RGB", (3000, 3000))
    buffer = io.BytesIO()
    big.save(buffer, format="PNG")
    with pytest.raises(ImageError, match="3000x3000 pixels, more than the limit of 1000000"):
        MediaPolicy(max_pixels=1_000_000).load_images([buffer.getvalue()])


def header_only_png(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels and holds almost no data: what a decompression bomb's header looks
    like (decoding it fails, so a test answered with the pixel limit proves that nothing was decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def test_decompression_bombs_are_image_errors():
    with pytest.raises(ImageError, match=f"more than {Image.MAX_IMAGE_PIXELS} pixels, more than the limit of 67108864"):
        MediaPolicy().load_images([header_only_png(30000, 30000)])  # Pillow raises DecompressionBombError


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_decompression_bomb_warnings_raised_as_errors_are_image_errors():
    with pytest.raises(ImageError, match="more than the limit of 67108864"):
        MediaPolicy().load_images([header_only_png(10000, 10000)])


def test_request_limits_are_checked_before_fetching_or_decoding():
    fine = io.BytesIO()
    Image.new("RGB", (1000, 1000)).save(fine, format="PNG")
    policy = MediaPolicy(max_pixels=1_000_000, max_request_pixels=1_500_000, max_images=2)
    with pytest.raises(ImageError, match=r"2000000 pixels in all \(up to image 2\), more than the limit of 1500000"):
        policy.load_images([fine.getvalue(), header_only_png(1000, 1000)])
    with pytest.raises(ImageError, match="3 images, more than the limit of 2"):
        policy.load_images(["http://10.0.0.1/a.png"] * 3)  # remote media is off: never reached


def test_an_image_limit_above_pillows_is_refused():
    with pytest.raises(ValueError, match="above Pillow's decompression-bomb limit"):
        MediaPolicy(max_pixels=Image.MAX_IMAGE_PIXELS + 1)
