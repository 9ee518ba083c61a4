"""Images through a real server process with the official openai client, against the offline `LLM` API."""

from __future__ import annotations

import base64
import contextlib
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from heteroserve.sampling_params import SamplingParams
from tests.entrypoints.server_process import ServerProcess
from tests.gateway.test_chat_page import ARTIFACTS, last_reply, page, send, settings  # noqa: F401 - fixtures
from tests.model.tiny_vl import image, save_tiny_vl
from tests.multimodal.test_media import header_only_png

MAX_TOKENS = 8
QUESTION = "What is in this image?"
REMOTE_MEDIA_LIMITS = ("--media-fetch-timeout", "2", "--max-image-bytes", str(8 * 1024**2))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_vl("qwen2_vl", tmp_path_factory.mktemp("vl-server"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    image(3, 70, 90).save(folder / "local.png")
    return folder


def tiny_flags(tiny) -> list[str]:
    return [
        str(tiny.folder),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        str(16 * 1024**2),
    ]


@pytest.fixture(scope="module")
def vl_server(tiny, media_dir):
    process = ServerProcess(
        *tiny_flags(tiny),
        "--limit-mm-per-prompt",
        "image=2",
        "--max-image-pixels",
        str(1000 * 1000),
        "--max-request-image-pixels",
        str(1500 * 1000),
        "--allowed-local-media-path",
        str(media_dir),
        *REMOTE_MEDIA_LIMITS,
        "--allowed-media-domains",
        "127.0.0.1",
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def public_media_server(tiny):
    """Remote media on, no domains named: only hosts with public addresses, so nothing on this machine."""
    process = ServerProcess(
        *tiny_flags(tiny),
        "--allow-remote-media",
        *REMOTE_MEDIA_LIMITS,
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def image_host():
    """A web server on 127.0.0.1 that remote image URLs point at; it records each request's Host and path."""
    buffer = io.BytesIO()
    image(30, 64, 48).save(buffer, format="PNG")
    requests: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            requests.append((self.headers["Host"], self.path))
            if self.path == "/to-localhost.png":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{port}/cat.png")
                self.end_headers()
            elif self.path == "/missing.png":
                self.send_error(404, "nothing here", "internal-banner: printer-3f")
            else:
                self.send_response(200)
                self.end_headers()
                with contextlib.suppress(OSError):  # the client leaving mid-body
                    self.write_body()

        def write_body(self) -> None:
            """/drip.png: a byte a second for a minute; /endless.png: 64 KiB blocks forever; else the picture."""
            if self.path == "/drip.png":
                for _ in range(60):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(1)
            elif self.path == "/endless.png":
                while True:
                    self.wfile.write(b"\0" * 65536)
            else:
                self.wfile.write(buffer.getvalue())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{port}", requests
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def client(vl_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vl_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny):
    return tiny.llm(kv_cache_memory_bytes=16 * 1024**2, num_kv_blocks=None)


def encoded(picture, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(*urls: str, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def ask(client, msgs):
    return client.chat.completions.create(model=None, messages=msgs, temperature=0, max_tokens=MAX_TOKENS)


def offline_answer(offline, msgs):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return offline.chat(msgs, params, use_tqdm=False)[0]


def test_base64_image_gives_the_offline_tokens(client, offline):
    msgs = messages(encoded(image(1, 100, 150)))
    served = ask(client, msgs)
    expected = offline_answer(offline, msgs)
    assert served.choices[0].message.content == expected.outputs[0].text
    assert served.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert served.usage.completion_tokens == MAX_TOKENS


def test_image_formats_and_gif_first_frame(client, offline):
    picture = image(2, 84, 84)
    answers = {fmt: ask(client, messages(encoded(picture, fmt))).choices[0].message.content for fmt in ("PNG", "WEBP")}
    assert answers["PNG"] == answers["WEBP"] == offline_answer(offline, messages(encoded(picture))).outputs[0].text
    jpeg = ask(client, messages(encoded(picture, "JPEG")))
    assert jpeg.usage.completion_tokens == MAX_TOKENS
    buffer = io.BytesIO()
    frames = [picture.quantize(), image(9, 84, 84).quantize()]
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    gif_url = "data:image/gif;base64," + base64.b64encode(buffer.getvalue()).decode()
    first_frame = encoded(frames[0].convert("RGB"))
    assert (
        ask(client, messages(gif_url)).choices[0].message.content
        == ask(client, messages(first_frame)).choices[0].message.content
    )


def test_local_file_under_the_allowed_path(client, offline, media_dir):
    served = ask(client, messages(f"file://{media_dir / 'local.png'}"))
    assert (
        served.choices[0].message.content
        == offline_answer(offline, messages(encoded(image(3, 70, 90)))).outputs[0].text
    )


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("data:image/png;base64," + base64.b64encode(b"definitely not a png").decode(), "cannot decode the image"),
        ("data:image/png;base64,@@@", "base64 payload is invalid"),
        ("https://example.com/cat.png", "could not be fetched"),  # not in --allowed-media-domains: not resolved
        ("file:///etc/passwd", "outside the allowed local media path"),
    ],
    ids=["undecodable", "bad-base64", "remote-not-allowed", "local-outside"],
)
def test_bad_image_urls_are_400s(client, url, problem):
    with pytest.raises(openai.BadRequestError, match=problem):
        ask(client, messages(url))


def test_unsupported_format_too_many_pixels_too_many_images(client):
    with pytest.raises(openai.BadRequestError, match="unsupported image format BMP"):
        ask(client, messages(encoded(image(4, 30, 30), "BMP")))
    with pytest.raises(openai.BadRequestError, match="1001x1000 pixels, more than the limit"):
        ask(client, messages(encoded(image(5, 1001, 1000))))
    small = encoded(image(6, 56, 56))
    with pytest.raises(openai.BadRequestError, match="3 images, more than the limit of 2"):
        ask(client, messages(small, small, small))


def test_decompression_bomb_and_the_request_pixel_total_are_400s(client):
    """A 30000x30000 PNG of a few hundred bytes is refused from its header; so is a second image past the
    request's total (header-only and undecodable: the limit, not a decoding error, answers)."""
    with pytest.raises(openai.BadRequestError, match="pixels, more than the limit of 1000000"):
        ask(client, messages("data:image/png;base64," + base64.b64encode(header_only_png(30000, 30000)).decode()))
    second = "data:image/png;base64," + base64.b64encode(header_only_png(1000, 1000)).decode()
    with pytest.raises(openai.BadRequestError, match=r"2000000 pixels in all \(up to image 2\), more than the limit"):
        ask(client, messages(encoded(image(8, 1000, 1000)), second))


def refusal(client, url: str) -> str:
    """The message of the 400 that a chat request with the image at `url` gets."""
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, messages(url))
    return refused.value.response.json()["error"]["message"]


def test_remote_images_from_the_allowed_domain(client, vl_server, image_host):
    """Fetched from 127.0.0.1 (named in --allowed-media-domains); a redirect to another host, an error page, a
    server dripping bytes and one streaming past the size cap all get one message that says nothing of them."""
    base, requests = image_host
    buffer = io.BytesIO()
    image(30, 64, 48).save(buffer, format="PNG")
    inline = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    assert (
        ask(client, messages(f"{base}/cat.png")).choices[0].message.content
        == ask(client, messages(inline)).choices[0].message.content
    )
    for path in ("/to-localhost.png", "/missing.png", "/endless.png"):
        assert refusal(client, base + path) == f"the image at {base}{path} could not be fetched"
    assert not any(host.startswith("localhost") for host, _ in requests)  # the redirect was not followed
    start = time.monotonic()
    assert refusal(client, f"{base}/drip.png") == f"the image at {base}/drip.png could not be fetched"
    assert time.monotonic() - start < 10  # the deadline is 2 s for all of it; the body would take 60 s
    log = vl_server.log_text()
    assert "localhost is not in --allowed-media-domains" in log
    assert "answered HTTP 404" in log
    assert f"the body is larger than the limit of {8 * 1024**2} bytes" in log
    assert "was not done by the deadline of 2.0 s" in log


def test_remote_media_reaches_no_address_of_this_machine(public_media_server, image_host):
    """With --allow-remote-media alone, loopback in any spelling is refused before anything connects."""
    client = openai.OpenAI(base_url=f"{public_media_server.base_url}/v1", api_key="unused", max_retries=0)
    base, requests = image_host
    port = base.rsplit(":", 1)[1]
    asked_before = len(requests)
    for host in ("127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "0.0.0.0"):
        url = f"http://{host}:{port}/cat.png"
        assert refusal(client, url) == f"the image at {url} could not be fetched"
    assert len(requests) == asked_before
    assert public_media_server.log_text().count("resolves to the non-public address") == 4


def test_image_to_a_text_only_model_is_a_400(server):
    text_client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="text-only model: it does not accept images"):
        ask(text_client, messages(encoded(image(7, 56, 56))))


def test_concurrent_text_and_image_requests_equal_solo_runs(client):
    conversations = [
        messages(encoded(image(10, 100, 150))),
        [{"role": "user", "content": "A cat and a dog."}],
        messages(encoded(image(11, 150, 100)), encoded(image(12, 56, 84))),
        [{"role": "user", "content": QUESTION}],
    ]
    solo = [ask(client, m).choices[0].message.content for m in conversations]
    with ThreadPoolExecutor(len(conversations) * 2) as pool:
        together = list(pool.map(lambda m: ask(client, m).choices[0].message.content, conversations * 2))
    assert together == solo * 2


def test_chat_page_attaches_and_pastes_images(vl_server, offline, page, tmp_path):  # noqa: F811 - fixture
    """The web page sends an attached image, then a pasted one, as data: URLs; answers equal the offline API's."""
    first, second = image(20, 100, 150), image(21, 84, 56)
    first.save(tmp_path / "first.png")
    page.goto(vl_server.base_url)
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    settings(page, max_tokens=MAX_TOKENS)

    page.set_input_files("#attach", str(tmp_path / "first.png"))
    page.wait_for_function("document.querySelectorAll('#attachments img').length === 1")
    send(page, QUESTION)
    page.wait_for_function("!document.getElementById('send').disabled && document.querySelector('.msg.assistant')")
    shown = page.locator(".msg.user img").first.get_attribute("src")
    assert shown.startswith("data:image/png;base64,")
    assert page.locator("#attachments img").count() == 0
    conversation = messages(encoded(first))
    reply = offline_answer(offline, conversation).outputs[0].text
    assert last_reply(page) == reply.strip()

    pasted = base64.b64encode(base64.b64decode(encoded(second).split(",", 1)[1])).decode()
    page.evaluate(
        """(b64) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const data = new DataTransfer();
            data.items.add(new File([bytes], "pasted.png", { type: "image/png" }));
            const paste = new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true });
            document.getElementById("input").dispatchEvent(paste);
        }""",
        pasted,
    )
    page.wait_for_function("document.querySelectorAll('#attachments img').length === 1")
    send(page, "Describe the picture in one sentence.")
    page.wait_for_function(
        "!document.getElementById('send').disabled && document.querySelectorAll('.msg.assistant').length === 2"
    )
    assert page.locator(".msg.user img").count() == 2
    conversation += [{"role": "assistant", "content": reply}]
    conversation += messages(encoded(second), text="Describe the picture in one sentence.")
    assert last_reply(page) == offline_answer(offline, conversation).outputs[0].text.strip()
    assert page.locator(".msg.error").count() == 0
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat_page_images.png"))


def test_a_folder_model_is_served_under_its_folders_name(client, tiny):
    """No --served-model-name: the card's id is the folder's base name and its root the path given; a request that
    names the model by that path (as clients of vLLM, which serves a folder under its path, do) is served too."""
    card = client.models.list().data[0].model_dump()
    assert (card["id"], card["root"]) == (tiny.folder.name, str(tiny.folder))
    for name in (tiny.folder.name, str(tiny.folder)):
        reply = client.chat.completions.create(model=name, messages=messages(text="Hi"), max_tokens=2)
        assert reply.model == tiny.folder.name
