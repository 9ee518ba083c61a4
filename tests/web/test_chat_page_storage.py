"""The chat page keeps what it is given (issue #40): conversations in IndexedDB, one record each, so two tabs of one
browser both keep theirs and see each other's; an answer saved as it streams, cut by a reload and marked
interrupted, never sent back empty, and still streaming when another conversation is opened; an edited answer as a
new alternative; an import that adds nothing twice; the localStorage conversations of older pages moved over.
A screenshot goes to tests/artifacts/chat_page_interrupted.png."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import needs_chromium
from tests.web.test_chat_page_ui import ANSWER, QUESTION, bodies, open_page, screenshot, send, settings, wait_idle

expect = pytest.importorskip("playwright.sync_api").expect

pytestmark = needs_chromium

STORY = "Write a very long story about a dragon who learns to cook."


def titles(page):
    return page.locator("#conversations .open")


def ready(page) -> None:
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")


def chat_requests(page) -> list[dict]:
    """The bodies of the page's /v1/chat/completions requests, as they are sent."""
    sent: list[dict] = []
    page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    return sent


def test_two_tabs_see_each_others_conversations(browser, server):
    context, first, errors = open_page(browser, server, 1280)
    second = context.new_page()
    second.set_default_timeout(60_000)
    second.goto(server.base_url)
    ready(second)
    for page in (first, second):
        settings(page, max_tokens=8)
    first.bring_to_front()  # the tab in the back is a hidden one, whose frames and timers are slowed
    send(first, "Hi!")
    wait_idle(first, 1)
    expect(titles(second)).to_have_text(["Hi!"])  # arrived without a reload
    second.bring_to_front()
    send(second, QUESTION)  # the second tab's own conversation, beside the first's
    wait_idle(second, 1)
    expect(titles(first)).to_have_text([QUESTION, "Hi!"])
    expect(titles(second)).to_have_text([QUESTION, "Hi!"])
    assert bodies(first, "user") == ["Hi!"] and bodies(second, "user") == [QUESTION]

    second.locator("#conversations .rename").last.click()  # a rename and a delete reach the other tab
    second.fill("#conversations input", "Greeting")
    second.press("#conversations input", "Enter")
    expect(titles(first)).to_have_text(["Greeting", QUESTION])  # a save puts it first, as before
    expect(first.locator("#title")).to_have_text("Greeting")
    first.bring_to_front()
    first.locator("#conversations .delete").last.click()
    first.locator("#conversations .delete.armed").click()
    expect(titles(second)).to_have_text(["Greeting"])
    expect(second.locator(".msg.user .body")).to_have_text(["Hi!"])  # the deleted one was open: the next opens
    second.reload()
    ready(second)
    expect(titles(second)).to_have_text(["Greeting"])
    assert errors == []
    context.close()


def test_a_reload_mid_answer_keeps_it_interrupted_and_never_sends_an_empty_one(browser, server):
    context, page, errors = open_page(browser, server, 1280)
    settings(page, max_tokens=300)
    send(page, STORY)
    answer = page.locator(".msg.assistant .body").first
    page.wait_for_function("document.querySelector('.msg.assistant .body')?.innerText.length > 40")
    page.wait_for_timeout(700)  # a save every 500 ms
    page.reload()
    ready(page)
    interrupted = page.locator(".msg.assistant.interrupted")
    expect(interrupted.locator(".meta")).to_have_text("interrupted")
    partial = answer.inner_text()
    assert len(partial) > 40 and not page.locator("#send").is_disabled()

    page.route("**/v1/chat/completions", lambda route: None)  # an answer that never comes: cut before a token
    send(page, "Go on.")
    page.wait_for_timeout(700)
    page.reload()
    ready(page)
    page.unroute("**/v1/chat/completions")
    expect(page.locator(".msg.assistant.interrupted")).to_have_count(2)
    assert bodies(page, "assistant")[1] == ""
    screenshot(page, "interrupted")

    sent = chat_requests(page)
    settings(page, max_tokens=4)
    send(page, "Thanks.")
    wait_idle(page, 3)
    history = sent[-1]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "user", "user"]
    assert len(history[1]["content"]) > 40  # the interrupted answer goes as far as it got
    assert partial.split()[-1].strip("*_#.,!?") in history[1]["content"]
    assert all(m["content"] for m in history)
    assert errors == []
    context.close()


def test_without_web_locks_an_answer_is_judged_cut_by_its_age(browser, server):
    """A LAN address over http has no navigator.locks: an answer unsaved for 3 s is taken as cut."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.add_init_script("Object.defineProperty(Navigator.prototype, 'locks', { get: () => undefined })")
    page = context.new_page()
    page.goto(server.base_url)
    ready(page)
    assert page.evaluate("navigator.locks") is None
    page.route("**/v1/chat/completions", lambda route: None)  # no token ever comes
    send(page, QUESTION)
    page.wait_for_timeout(700)
    page.reload()
    ready(page)
    expect(page.locator(".msg.assistant.interrupted")).to_have_count(1, timeout=10_000)
    assert not page.locator("#send").is_disabled()
    context.close()


def test_an_answer_keeps_streaming_in_its_conversation_while_another_is_open(browser, server):
    context, page, errors = open_page(browser, server, 1280)
    settings(page, max_tokens=80)
    send(page, STORY)
    page.wait_for_function("document.querySelector('.msg.assistant .body')?.innerText.length > 20")
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0 and not page.locator("#send").is_disabled()
    page.wait_for_timeout(1000)
    page.locator("#conversations .open", has_text="dragon").click()
    wait_idle(page, 1)
    meta = page.locator(".msg.assistant .meta").inner_text()
    assert "tokens/s" in meta and "stopped" not in meta and len(bodies(page, "assistant")[0]) > 80
    page.reload()  # finished while away, and saved so
    ready(page)
    expect(page.locator(".msg.assistant .meta")).to_contain_text("tokens/s")
    assert page.locator(".msg.assistant.interrupted").count() == 0
    assert errors == []
    context.close()


def test_an_edited_answer_is_a_new_alternative(browser, server, tmp_path):
    context, page, errors = open_page(browser, server, 1280)
    stats = {"completion_tokens": 8, "tokens_per_s": 20.0}
    conversation = {"title": "Capitals", "messages": [{"role": "user", "content": QUESTION}]}
    conversation["messages"].append({"role": "assistant", "content": ANSWER, "stats": stats})
    file = tmp_path / "capitals.json"
    file.write_text(json.dumps(conversation))
    page.set_input_files("#import-file", str(file))
    expect(page.locator(".msg.assistant .meta")).to_have_text("8 tokens · 20.0 tokens/s")

    page.locator(".msg.assistant .edit").click()
    page.fill(".msg.assistant .edit-box", "Paris.")
    page.locator(".msg.assistant .save-edit").click()
    expect(page.locator(".msg.assistant .body")).to_have_text(["Paris."])
    assert page.locator(".msg.assistant .siblings").inner_text() == "2/2"
    assert page.locator(".msg.assistant .meta").inner_text() == "edited"  # its own stats, not the old answer's
    page.reload()
    ready(page)
    page.locator(".msg.assistant .prev").click()
    expect(page.locator(".msg.assistant .body")).to_have_text([ANSWER])
    assert page.locator(".msg.assistant .meta").inner_text() == "8 tokens · 20.0 tokens/s"
    assert page.locator(".msg.assistant .siblings").inner_text() == "1/2"
    assert errors == []
    context.close()


def test_importing_a_file_twice_adds_nothing_the_second_time(browser, server, tmp_path):
    context, page, errors = open_page(browser, server, 1280)
    exported = {"format": "heteroserve-chat", "version": 1, "conversations": []}
    for id, title in [("first", "One"), ("second", "Two")]:
        messages = [{"role": "user", "content": f"{title}?"}, {"role": "assistant", "content": f"{title}."}]
        exported["conversations"].append({"id": id, "title": title, "messages": messages})
    file = tmp_path / "conversations.json"
    file.write_text(json.dumps(exported))
    page.set_input_files("#import-file", str(file))
    notice = page.locator(".msg.notice .body").last
    expect(notice).to_have_text("Imported 2 conversations from conversations.json.")
    expect(titles(page)).to_have_text(["One", "Two"])

    with page.expect_download() as download:  # our own export, imported back, adds nothing either
        page.click("#export")
    again = tmp_path / "again.json"
    again.write_text(Path(download.value.path()).read_text())
    page.set_input_files("#import-file", str(again))
    expect(notice).to_have_text("Imported 0 conversations from again.json; skipped 2 conversations already here.")
    page.set_input_files("#import-file", str(file))
    expect(notice).to_contain_text("from conversations.json; skipped 2 conversations already here.")
    expect(titles(page)).to_have_text(["One", "Two"])
    assert errors == []
    context.close()


def test_conversations_in_localstorage_are_moved_to_indexeddb_once(browser, server):
    """As the page before IndexedDB left them: an index, one key per conversation, and an orphan the index lost."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})

    def conversation(id, title, question, answer, updated):
        nodes = {
            "root": {"id": "root", "children": [f"{id}-q"], "active": f"{id}-q"},
            f"{id}-q": {"id": f"{id}-q", "parent": "root", "children": [f"{id}-a"], "active": f"{id}-a"},
            f"{id}-a": {"id": f"{id}-a", "parent": f"{id}-q", "children": [], "active": None},
        }
        nodes[f"{id}-q"] |= {"role": "user", "content": question}
        nodes[f"{id}-a"] |= {"role": "assistant", "content": answer, "stats": {"completion_tokens": 3}}
        return {"id": id, "title": title, "created": updated, "updated": updated, "nodes": nodes, "current": f"{id}-a"}

    old = {
        "heteroserve.conversations": [{"id": "old1", "title": "France", "updated": 2000}],
        "heteroserve.conversation.old1": conversation("old1", "France", QUESTION, ANSWER, 2000),
        "heteroserve.conversation.orphan": conversation("orphan", "Lost", "Hello?", "Hi.", 1000),
        "heteroserve.current": "old1",
        "heteroserve.theme": "auto",
    }
    seed = "if (!localStorage.getItem('seeded')) { for (const [k, v] of Object.entries(%s)) "
    seed += "localStorage.setItem(k, JSON.stringify(v)); localStorage.setItem('seeded', '1'); }"
    context.add_init_script(seed % json.dumps(old))
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(server.base_url)
    ready(page)
    expect(titles(page)).to_have_text(["France", "Lost"])
    assert bodies(page, "assistant") == [ANSWER]
    keys = page.evaluate("Object.keys(localStorage).filter((k) => k.startsWith('heteroserve.conversation'))")
    assert keys == []  # moved, not copied
    page.reload()
    ready(page)
    expect(titles(page)).to_have_text(["France", "Lost"])
    page.locator("#conversations .open", has_text="Lost").click()
    expect(page.locator(".msg.assistant .body")).to_have_text(["Hi."])
    context.close()
