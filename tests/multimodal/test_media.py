"""MediaPolicy against a real HTTP server on 127.0.0.1 and real files: fetching, limits, and refusals."""

from __future__ import annotations

import io
import threading
import time
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
    loaded = MediaPolicy(allow_remote=True).load(f"{http_server}/cat.png")
    assert np.array_equal(np.asarray(loaded), np.asarray(picture))
    with pytest.raises(ImageError, match="remote image URLs are disabled"):
        MediaPolicy().load(f"{http_server}/cat.png")


def test_remote_size_limit_and_timeout(http_server):
    with pytest.raises(ImageError, match="larger than the limit of 100 bytes"):
        MediaPolicy(allow_remote=True, max_bytes=100).load(f"{http_server}/cat.png")
    with pytest.raises(ImageError, match="cannot fetch the image"):
        MediaPolicy(allow_remote=True, timeout_s=0.3).load(f"{http_server}/slow.png")


def test_local_files_only_under_the_allowed_folder(tmp_path):
    body, picture = png_bytes(1)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(body)
    (tmp_path / "secret.png").write_bytes(body)
    (allowed / "escape.png").symlink_to(tmp_path / "secret.png")
    policy = MediaPolicy(allowed_local_path=allowed)
    assert np.array_equal(np.asarray(policy.load(f"file://{allowed / 'ok.png'}")), np.asarray(picture))
    for outside in (tmp_path / "secret.png", allowed / "escape.png", allowed / ".." / "secret.png"):
        with pytest.raises(ImageError, match="outside the allowed local media path"):
            policy.load(str(outside))
    with pytest.raises(ImageError, match="local image files are disabled"):
        MediaPolicy().load(str(allowed / "ok.png"))


def test_pixel_limit_is_checked_before_decoding():
    big = Image.new("RGB", (3000, 3000))
    buffer = io.BytesIO()
    big.save(buffer, format="PNG")
    with pytest.raises(ImageError, match="3000x3000 pixels, more than the limit of 1000000"):
        MediaPolicy(max_pixels=1_000_000).decode(buffer.getvalue())
