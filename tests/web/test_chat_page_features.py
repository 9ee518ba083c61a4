"""The chat page's additions after llama.cpp's UI, in the system's Chromium against the session server (SmolLM2):
text, code and PDF files attached as text (PDF.js loaded only then; a binary file or an image for a text model
refused with a message), continuing an answer cut at max_tokens, the context gauge, Ctrl+K, "Copied", "no
matches", the typing indicator before the first token, the favicon, and no focus stop that cannot be seen."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.conftest import needs_chromium
from tests.web.test_chat_page_storage import chat_requests
from tests.web.test_chat_page_ui import ANSWER, PNG_1X1, QUESTION, bodies, open_page, send, settings, wait_idle

expect = pytest.importorskip("playwright.sync_api").expect

pytestmark = needs_chromium

SOURCE = "def secret():\n    return 'tangerine-42'\n"
PDF_SENTENCE = "The launch code is zebra-7."


def pdf_with_text(line: str) -> bytes:
    """A one-page PDF showing `line` in Helvetica, written by hand (no PDF library needed)."""
    stream = f"BT /F1 18 Tf 72 720 Td ({line}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
        b" /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def notices(page) -> list[str]:
    return page.locator(".msg.notice .body").all_inner_texts()


def test_files_go_as_text_and_what_cannot_be_read_is_refused_aloud(browser, server, tmp_path):
    context, page, errors = open_page(browser, server, 1280)
    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url))
    sent = chat_requests(page)
    settings(page, max_tokens=4)
    files = {"notes.py": SOURCE.encode(), "report.pdf": pdf_with_text(PDF_SENTENCE)}
    files |= {"blob.bin": bytes(range(256)), "dot.png": bytes.fromhex(PNG_1X1)}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    assert page.locator("#attach-button").is_visible()  # text files go to any model
    assert not any("pdfjs" in url for url in fetched)  # PDF.js waits for a PDF

    page.set_input_files("#attach", [str(tmp_path / name) for name in files])
    chips = page.locator("#attachments .attachment")
    expect(chips).to_have_count(2)
    assert [chips.nth(i).get_attribute("aria-label") for i in range(2)] == ["Remove notes.py", "Remove report.pdf"]
    assert notices(page) == [
        "Not attached: blob.bin is not a text, code, PDF or image file",
        f"Not attached: dot.png: {page.input_value('#model')} does not take images",
    ]
    assert any(url.endswith("/vendor/pdfjs/pdf.min.mjs") for url in fetched)

    send(page, "Summarise the files.")
    wait_idle(page, 1)
    content = sent[-1]["messages"][-1]["content"]
    assert content.startswith("notes.py:\n```\n" + SOURCE) and content.endswith("\n\nSummarise the files.")
    assert f"report.pdf:\n```\n{PDF_SENTENCE}\n```" in content
    assert "prompt" in page.locator(".msg.assistant .meta").inner_text()  # the server took it
    shown = page.locator(".msg.user details.file summary").all_inner_texts()
    assert shown == [f"notes.py ({len(SOURCE)} characters)", f"report.pdf ({len(PDF_SENTENCE)} characters)"]
    expect(chips).to_have_count(0)
    assert page.locator("#conversations .open").all_inner_texts() == ["Summarise the files."]
    assert errors == []
    context.close()


def test_a_cut_answer_continues_in_place_and_the_gauge_counts_the_context(browser, server):
    context, page, errors = open_page(browser, server, 1280)
    sent = chat_requests(page)
    gauge = page.locator("#context .count")
    expect(gauge).to_have_text("0 / 512")
    settings(page, max_tokens=4)
    send(page, QUESTION)
    wait_idle(page, 1)
    partial = bodies(page, "assistant")[0]
    answer = page.locator(".msg.assistant")
    assert "cut at max tokens" in answer.locator(".meta").inner_text()
    used = int(gauge.inner_text().split(" / ")[0])
    usage_shown = re.search(r"4 tokens .* prompt (\d+) tokens", answer.locator(".meta").inner_text())
    assert usage_shown and used == int(usage_shown.group(1)) + 4

    settings(page, max_tokens=40)
    answer.locator(".continue").click()
    page.wait_for_function("document.querySelector('.msg.assistant .meta')?.innerText.includes('continued')")
    wait_idle(page, 1)
    request = sent[-1]
    assert request["continue_final_message"] is True and request["add_generation_prompt"] is False
    assert request["messages"][-1] == {"role": "assistant", "content": partial}
    text = bodies(page, "assistant")[0]
    assert text.startswith(partial) and text == ANSWER  # went on where it was cut, nothing said twice
    assert page.locator(".msg.assistant").count() == 1 and answer.locator(".continue").count() == 0
    assert int(gauge.inner_text().split(" / ")[0]) > used
    assert errors == []
    context.close()


def sse(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_typing_copied_no_matches_ctrl_k_and_the_favicon(browser, server):
    context, page, errors = open_page(browser, server, 1280)
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    held = []
    page.route("**/v1/chat/completions", lambda route: held.append(route))  # the answer waits for the test
    send(page, "Hello")
    expect(page.locator(".msg.assistant .typing")).to_be_visible()
    delta = {"choices": [{"index": 0, "delta": {"content": "Hi there"}, "finish_reason": None}]}
    cut = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}
    held[0].fulfill(status=200, headers={"content-type": "text/event-stream"}, body=sse(delta, cut, usage))
    wait_idle(page, 1)
    assert page.locator(".typing").count() == 0 and bodies(page, "assistant") == ["Hi there"]
    expect(page.locator(".msg.assistant .continue")).to_be_visible()
    expect(page.locator("#context .count")).to_have_text("11 / 512")

    copy = page.locator(".msg.assistant .copy")
    copy.click()
    expect(copy).to_have_text("Copied")
    expect(page.locator("#announce")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "Hi there"
    expect(copy).to_have_text("Copy")

    with page.expect_file_chooser() as chooser:  # Import is a real button too
        page.click("#import")
    assert not chooser.value.is_multiple()
    page.click("#toggle-sidebar")  # the list folded away: Ctrl+K shows it and puts the cursor in the search
    assert not page.locator("#search").is_visible()
    page.locator("#input").focus()
    page.keyboard.press("Control+k")
    expect(page.locator("#search")).to_be_focused()
    page.keyboard.type("zebra")
    expect(page.locator("#no-matches")).to_have_text("No conversation matches “zebra”")
    assert page.locator("#conversations li").count() == 0
    page.fill("#search", "hello")
    expect(page.locator("#no-matches")).to_have_text("")
    assert page.locator("#conversations li").count() == 1

    icon = page.locator("link[rel=icon]").get_attribute("href")
    response = httpx.get(server.base_url + icon)
    assert response.status_code == 200 and response.headers["content-type"] == "image/svg+xml"
    assert errors == []
    context.close()


def test_every_focus_stop_is_seen_and_ctrl_k_opens_the_drawer_on_a_phone(browser, server):
    context, page, errors = open_page(browser, server, 390, 844)
    focused = """() => { const e = document.activeElement, r = e.getBoundingClientRect();
        return [e.id || e.className, r.width > 0 && r.height > 0 && r.right > 0 && r.left < innerWidth
                && getComputedStyle(e).visibility === "visible"]; }"""
    stops = []
    for _ in range(12):  # Tab through the page: the closed drawer's and the file inputs' controls are not stops
        page.keyboard.press("Tab")
        stops.append(page.evaluate(focused))
    assert all(seen for _, seen in stops), stops
    assert "attach-button" in dict(stops)
    with page.expect_file_chooser() as chooser:  # a real button that opens the file picker
        page.click("#attach-button")
    assert chooser.value.is_multiple()
    assert not page.locator("#search").is_visible()
    page.keyboard.press("Control+k")
    expect(page.locator("#search")).to_be_focused()
    page.wait_for_function("document.querySelector('aside').getBoundingClientRect().left >= 0")
    assert errors == []
    context.close()
