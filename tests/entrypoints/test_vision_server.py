"""Images through a real server process with the official openai client, against the offline `LLM` API."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from heteroserve.sampling_params import SamplingParams
from tests.entrypoints.server_process import ServerProcess
from tests.gateway.test_chat_page import ARTIFACTS, browser, last_reply, page, send, settings  # noqa: F401 - fixtures
from tests.model.tiny_vl import image, save_tiny_vl

MAX_TOKENS = 8
QUESTION = "What is in this image?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_vl("qwen2_vl", tmp_path_factory.mktemp("vl-server"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    image(3, 70, 90).save(folder / "local.png")
    return folder


@pytest.fixture(scope="module")
def vl_server(tiny, media_dir):
    process = ServerProcess(
        str(tiny.folder),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        str(16 * 1024**2),
        "--limit-mm-per-prompt",
        "image=2",
        "--max-image-pixels",
        str(1000 * 1000),
        "--allowed-local-media-path",
        str(media_dir),
    )
    yield process
    process.stop()


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
        ("https://example.com/cat.png", "remote image URLs are disabled"),
        ("file:///etc/passwd", "outside the allowed local media path"),
    ],
    ids=["undecodable", "bad-base64", "remote-off", "local-outside"],
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
