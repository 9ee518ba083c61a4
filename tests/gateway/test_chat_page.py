"""The chat page in headless Chromium, against the session server (the default model) and the gateway
(several models): models listed, a streamed reply, stop mid-stream, switching models, a 4xx shown.
Screenshots go to tests/artifacts/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import needs_chromium

ARTIFACTS = Path(__file__).parents[1] / "artifacts"
QUESTION = "What is the capital of France?"

pytestmark = needs_chromium


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    page.set_default_timeout(60_000)
    yield page
    context.close()


def settings(page, temperature: float = 0, max_tokens: int = 40) -> None:
    page.evaluate(
        """([t, m]) => {
            for (const [id, v] of [["temperature", t], ["max-tokens", m]]) {
                const el = document.getElementById(id); el.value = v; el.dispatchEvent(new Event("input"));
                el.dispatchEvent(new Event("change"));
            }
        }""",
        [temperature, max_tokens],
    )


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def last_reply(page) -> str:
    return page.locator(".msg.assistant .body").last.inner_text()


def test_chat_stop_and_errors_on_the_server(page, server):
    page.goto(server.base_url)
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    assert page.locator("#model option").all_inner_texts() == ["SmolLM2-135M-Instruct"]

    settings(page)
    send(page, QUESTION)
    page.wait_for_function(
        "document.getElementById('send').disabled === false && document.querySelector('.msg.assistant')"
    )
    assert last_reply(page) == "The capital of France is Paris."
    assert page.locator(".msg.error").count() == 0

    settings(page, max_tokens=400)
    send(page, "Write a very long story about a dragon who learns to cook. Make it at least 2000 words.")
    page.wait_for_function(  # streamed: text shows while the answer is still coming
        "!document.getElementById('stop').disabled && document.querySelectorAll('.msg.assistant').length === 2"
        " && document.querySelectorAll('.msg.assistant .body')[1].innerText.length > 40"
    )
    page.click("#stop")
    page.wait_for_function("document.getElementById('stop').disabled && !document.getElementById('send').disabled")
    stopped = last_reply(page)
    page.wait_for_timeout(1000)
    assert last_reply(page) == stopped and 40 < len(stopped) < 1500
    assert page.locator(".msg.error").count() == 0
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat_page_stopped.png"))

    send(page, "hello " * 600)  # longer than the server's 512-token context: a 400
    error = page.locator(".msg.error").last
    error.wait_for()
    assert error.inner_text().startswith("error\n400: ")
    assert not page.locator("#send").is_disabled()
    assert page.locator(".msg.user.failed").count() == 1
    send(page, QUESTION)  # the refused turn is not sent again
    page.wait_for_function(
        "document.querySelectorAll('.msg.assistant').length === 3 && !document.getElementById('send').disabled"
    )
    assert last_reply(page) == "The capital of France is Paris."
    page.screenshot(path=str(ARTIFACTS / "chat_page_error.png"))


def test_switching_models_through_the_gateway(page, gateway):
    page.goto(gateway.base_url)
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    assert page.locator("#model option").all_inner_texts() == sorted(
        ["SmolLM2-135M-Instruct", "smol", "tiny", "tiny-alias", "echo"]
    )
    settings(page)
    page.select_option("#model", "echo")
    send(page, "hi")
    page.wait_for_function("!document.getElementById('send').disabled && document.querySelector('.msg.assistant')")
    assert last_reply(page) == "xxxxx"  # the stand-in's stream

    page.select_option("#model", "smol")
    send(page, QUESTION)
    page.wait_for_function(
        "!document.getElementById('send').disabled && document.querySelectorAll('.msg.assistant').length === 2"
    )
    assert last_reply(page) == "The capital of France is Paris."

    page.select_option("#model", "tiny")  # no tokenizer: chat is a 400
    send(page, "hi")
    error = page.locator(".msg.error").last
    error.wait_for()
    assert "400: " in error.inner_text()
    page.screenshot(path=str(ARTIFACTS / "chat_page_gateway.png"))
