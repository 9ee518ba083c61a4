"""The chat page in the system's headless Chromium against the session server (SmolLM2, a text model), at a
desktop's 1280 px and a phone's 390 px: conversations (new, switch, reload), a streamed reply, stop, regenerate and
edit with their alternatives, rendering of an imported conversation (table, code, math, reasoning, hostile HTML),
dark mode. Screenshots go to tests/artifacts/chat_page_*.png."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import needs_chromium

expect = pytest.importorskip("playwright.sync_api").expect

ARTIFACTS = Path(__file__).parents[1] / "artifacts"
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."

pytestmark = needs_chromium

# What a model might answer: every construct the page renders, and HTML that must never run.
RICH_ANSWER = """<think>The user wants a table.</think>Here is a *table*:

| City | Country |
|------|---------|
| Paris | France |

1. first
2. second

> quoted

```python
def greet(name):
    return f"hello {name}"
```

Euler: $e^{i\\pi} + 1 = 0$ and

$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$

<img src=x onerror="window.__xss = 'img'"> <script>window.__xss = 'script'</script>
[click](javascript:window.__xss='link')"""


PNG_1X1 = (
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d4944415478da63f8cfc0f01f0005000201e2213bbc0000000049454e44ae426082"
)


def open_page(browser, server, width: int, height: int = 800):
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.base_url)
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    return context, page, errors


def settings(page, temperature: float = 0, max_tokens: int = 40) -> None:
    page.evaluate(
        """([t, m]) => {
            for (const [id, v] of [["temperature", t], ["max-tokens", m]]) {
                const el = document.getElementById(id); el.value = v; el.dispatchEvent(new Event("change"));
            }
        }""",
        [temperature, max_tokens],
    )


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_idle(page, assistants: int) -> None:
    idle = "!document.getElementById('send').disabled"
    page.wait_for_function(f"{idle} && document.querySelectorAll('.msg.assistant').length === {assistants}")


def bodies(page, role: str) -> list[str]:
    return page.locator(f".msg.{role} .body").all_inner_texts()


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"chat_page_{name}.png"))


def test_conversations_streaming_and_alternatives_at_1280(browser, server):
    context, page, errors = open_page(browser, server, 1280)
    assert "images" not in page.get_attribute("#attach-button", "aria-label")  # SmolLM2 takes no images
    settings(page)
    send(page, QUESTION)
    wait_idle(page, 1)
    assert bodies(page, "assistant") == [ANSWER]
    assert "tokens/s" in page.locator(".msg.assistant .meta").inner_text()

    settings(page, max_tokens=300)  # streamed: the text grows while the answer is still coming, then Esc stops it
    send(page, "Write a very long story about a dragon who learns to cook.")
    streaming = "!document.getElementById('stop').disabled && document.querySelectorAll('.msg.assistant').length === 2"
    page.wait_for_function(f"{streaming} && document.querySelectorAll('.msg.assistant .body')[1].innerText.length > 30")
    seen = len(bodies(page, "assistant")[1])
    page.wait_for_function(
        f"{streaming} && document.querySelectorAll('.msg.assistant .body')[1].innerText.length > {seen + 20}"
    )
    page.keyboard.press("Escape")
    page.wait_for_function("document.getElementById('stop').disabled")
    stopped = bodies(page, "assistant")[1]
    page.wait_for_timeout(500)
    assert bodies(page, "assistant")[1] == stopped and len(stopped) < 1200
    assert "stopped" in page.locator(".msg.assistant .meta").nth(1).inner_text()

    settings(page, max_tokens=20)  # regenerate: a second alternative, the first still reachable
    page.locator(".msg.assistant").nth(1).locator(".regenerate").click()
    wait_idle(page, 2)
    assert page.locator(".msg.assistant").nth(1).locator(".siblings").inner_text() == "2/2"
    page.locator(".msg.assistant").nth(1).locator(".prev").click()
    assert page.locator(".msg.assistant").nth(1).locator(".siblings").inner_text() == "1/2"
    assert bodies(page, "assistant")[1] == stopped

    page.locator(".msg.user").first.locator(".edit").click()  # edit and resend: a new branch from the first turn
    page.fill(".msg.user .edit-box", "What is the capital of Germany?")
    page.locator(".msg.user .save-edit").click()
    wait_idle(page, 1)
    assert bodies(page, "user") == ["What is the capital of Germany?"]
    assert page.locator(".msg.user .siblings").inner_text() == "2/2"
    page.locator(".msg.user .prev").click()
    assert bodies(page, "user")[0] == QUESTION and bodies(page, "assistant")[0] == ANSWER
    assert page.locator(".msg").count() == 4
    screenshot(page, "desktop")

    page.click("#new-chat")  # a second conversation, then switch between the two
    assert page.locator(".msg").count() == 0
    send(page, "Hi!")
    wait_idle(page, 1)
    titles = page.locator("#conversations .open").all_inner_texts()
    assert titles == ["Hi!", QUESTION]
    page.locator("#conversations .open", has_text=QUESTION).click()  # read from IndexedDB: wait for it
    expect(page.locator(".msg.assistant .body").first).to_have_text(ANSWER)
    assert page.locator(".msg").count() == 4

    page.reload()  # both kept in the browser, the open one still open
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    assert page.locator("#conversations .open").all_inner_texts() == ["Hi!", QUESTION]
    assert bodies(page, "assistant")[0] == ANSWER and page.locator(".msg").count() == 4
    page.locator("#conversations .open", has_text="Hi!").click()
    expect(page.locator(".msg.user .body")).to_have_text(["Hi!"])

    page.locator("#conversations .rename").first.click()  # rename, search (titles and messages), export, delete
    page.fill("#conversations input", "Greeting")
    page.press("#conversations input", "Enter")
    assert page.locator("#conversations .open").all_inner_texts() == ["Greeting", QUESTION]
    assert page.locator("#title").inner_text() == "Greeting"
    page.fill("#search", "germany")
    assert page.locator("#conversations .open").all_inner_texts() == [QUESTION]
    page.fill("#search", "")
    with page.expect_download() as download:
        page.click("#export")
    exported = json.loads(Path(download.value.path()).read_text())
    assert [c["title"] for c in exported["conversations"]] == ["Greeting", QUESTION]
    page.locator("#conversations .delete").first.click()
    page.locator("#conversations .delete.armed").click()  # a second click deletes
    assert page.locator("#conversations .open").all_inner_texts() == [QUESTION]
    expect(page.locator(".msg.user .body").first).to_have_text(QUESTION)
    assert errors == []
    context.close()


def test_imported_conversation_renders_safely_in_both_themes(browser, server, tmp_path):
    context, page, errors = open_page(browser, server, 1280)
    hostile_question = "<b>bold?</b> <img src=y onerror=\"window.__xss='user'\">"
    exported = {"title": "Rendering", "messages": [{"role": "user", "content": hostile_question}]}
    exported["messages"].append({"role": "assistant", "content": RICH_ANSWER})
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    tool_turn = {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [call]}
    exported["messages"].append(tool_turn)
    file = tmp_path / "conversation.json"
    file.write_text(json.dumps(exported))
    page.set_input_files("#import-file", str(file))
    answer = page.locator(".msg.assistant").first
    answer.locator("table").wait_for()
    assert answer.locator("th").all_inner_texts() == ["City", "Country"]
    assert answer.locator("td").all_inner_texts() == ["Paris", "France"]
    assert answer.locator("ol li").count() == 2 and answer.locator("blockquote").count() == 1
    assert answer.locator("em").inner_text() == "table"
    assert answer.locator("pre code .hljs-keyword").first.inner_text() == "def"
    assert answer.locator(".code .copy-code").count() == 1
    assert answer.locator(".katex").count() == 2 and answer.locator(".katex-display").count() == 1
    reasoning = answer.locator("details.reasoning")
    assert reasoning.locator(".thinking").text_content() == "The user wants a table."
    assert not reasoning.locator(".thinking").is_visible()  # collapsed until opened
    reasoning.locator("summary").click()
    assert reasoning.locator(".thinking").is_visible()
    assert "<think>" not in answer.locator(".body").inner_text()
    page.wait_for_timeout(300)  # the hostile HTML is text: nothing ran, no element was made of it
    assert page.evaluate("window.__xss") is None
    assert page.locator("#log script, #log img[src='x'], #log img[src='y'], #log [onerror]").count() == 0
    assert "onerror" in answer.locator(".body").inner_text()
    assert page.locator("#log a[href^='javascript']").count() == 0
    assert page.locator(".msg.user .body").inner_text().startswith("<b>bold?</b>")
    assert page.locator("#conversations .open").all_inner_texts() == ["Rendering"]
    shown = page.locator(".msg.assistant").nth(1)  # reasoning_content folded, the tool call's JSON indented
    assert shown.locator("details.reasoning .thinking").text_content() == "Look it up."
    assert shown.locator(".tool-call summary").inner_text() == "Tool call: get_weather"
    assert shown.locator(".tool-call pre").inner_text() == '{\n  "city": "Paris"\n}'
    screenshot(page, "markdown_light")

    background = "getComputedStyle(document.body).backgroundColor"
    light = page.evaluate(background)
    page.emulate_media(color_scheme="dark")
    dark = page.evaluate(background)
    assert light != dark and sum(map(int, dark[4:-1].split(","))) < 150
    screenshot(page, "markdown_dark")

    page.click("#open-settings")  # settings and presets
    page.fill("#top-k", "40")
    page.fill("#preset-name", "focused")
    page.click("#save-preset")
    page.fill("#top-k", "")
    page.select_option("#preset", "focused")
    assert page.input_value("#top-k") == "40"
    screenshot(page, "settings_dark")
    page.keyboard.press("Escape")
    assert errors == []
    context.close()


def test_image_button_follows_the_model_card(browser, server, tmp_path):
    """SmolLM2's card says no images (the tests above); a card that says yes takes them, with previews."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    card = {"id": "a-vision-model", "object": "model", "capabilities": {"vision": True}}
    page.route("**/v1/models", lambda route: route.fulfill(json={"object": "list", "data": [card]}))
    page.goto(server.base_url)
    expect(page.locator("#attach-button")).to_have_attribute("aria-label", re.compile("or images"))
    picture = tmp_path / "dot.png"
    picture.write_bytes(bytes.fromhex(PNG_1X1))
    page.set_input_files("#attach", str(picture))
    page.locator("#attachments img").wait_for()
    context.close()


def test_phone_width(browser, server):
    context, page, errors = open_page(browser, server, 390, 844)
    box = page.locator("#input").bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390 and box["y"] + box["height"] <= 844
    for control in ("#send", "#open-settings", "#theme"):  # every control on the screen, none pushed off it
        box = page.locator(control).bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390, control
    aside = page.locator("aside").bounding_box()
    assert aside["x"] + aside["width"] <= 0  # collapsed: the chat has the whole width
    assert page.locator("#log").bounding_box()["width"] == 390
    assert page.locator("#attach-button").is_visible()  # text files go to any model

    settings(page)
    send(page, QUESTION)
    wait_idle(page, 1)
    assert bodies(page, "assistant") == [ANSWER]
    screenshot(page, "phone")

    page.click("#toggle-sidebar")  # the drawer opens over the chat, and closes on a choice
    page.wait_for_function("document.querySelector('aside').getBoundingClientRect().left >= 0")
    assert page.locator("#conversations .open").all_inner_texts() == [QUESTION]
    screenshot(page, "phone_sidebar")
    page.click("#new-chat")
    page.wait_for_function("document.querySelector('aside').getBoundingClientRect().right <= 0")
    assert page.locator(".msg").count() == 0
    assert errors == []
    context.close()
