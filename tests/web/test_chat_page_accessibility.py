"""axe-core (tests/web/axe, installed by scripts/setup.sh) finds no violation on the chat page, at a desktop's
1280 x 800 and a phone's 390 x 844, in the light and the dark scheme, with a conversation open that holds what the
page draws: a question with an attached file, a rendered answer (table, code, math, a link, reasoning), a tool
call, and an answer cut at max_tokens (its Continue button); on the desktop with the settings open too, on the
phone with the conversation drawer open.
Tap targets are checked (axe's target-size rule: 24 px)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import needs_chromium
from tests.web.test_chat_page_ui import RICH_ANSWER, open_page

expect = pytest.importorskip("playwright.sync_api").expect

AXE = Path(__file__).parent / "axe" / "node_modules" / "axe-core" / "axe.min.js"

pytestmark = [
    needs_chromium,
    pytest.mark.skipif(not AXE.exists(), reason="no tests/web/axe/node_modules: scripts/setup.sh runs npm ci there"),
]

# Every kind of token highlight.js colours, for the contrast check.
CODE = """```javascript
// a comment
class Point { constructor(x) { this.x = x ?? 42; } }
const greet = (name) => `hello ${name}`; /* done */ if (true) console.log("s", /re+/g, null);
```"""

CONVERSATION = {
    "title": "Accessibility",
    "messages": [
        {"role": "user", "content": "Explain this file.", "files": [{"name": "notes.py", "text": "print('hi')\n"}]},
        {"role": "assistant", "content": RICH_ANSWER.split("<img")[0] + "[Docs](https://example.org)\n" + CODE},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Look it up.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}],
        },
        {"role": "user", "content": "And a long answer?"},
        {
            "role": "assistant",
            "content": "Once upon a time",
            "stats": {"completion_tokens": 4, "prompt_tokens": 30, "finish_reason": "length", "context_tokens": 34},
        },
    ],
}


def violations(page) -> list[str]:
    """axe's violations on the page as it is, one line each: the rule, what it says, and where."""
    if not page.evaluate("typeof window.axe === 'object'"):
        page.add_script_tag(path=str(AXE))
    found, checked = page.evaluate("""async () => {
        const result = await axe.run(document, { rules: { "target-size": { enabled: true } } });
        const where = (v) => v.nodes.map((n) => n.target.join(" ")).join(", ");
        return [result.violations.map((v) => `${v.id}: ${v.help} at ${where(v)}`),
                [...result.passes, ...result.violations].map((r) => r.id)];
    }""")
    assert {"color-contrast", "target-size", "label", "aria-allowed-attr"} <= set(checked)
    return found


@pytest.mark.parametrize("width, height", [(1280, 800), (390, 844)])
def test_no_axe_violations_in_either_scheme(browser, server, tmp_path, width, height):
    context, page, errors = open_page(browser, server, width, height)
    file = tmp_path / "conversation.json"
    file.write_text(json.dumps(CONVERSATION))
    page.set_input_files("#import-file", str(file))
    expect(page.locator(".msg.assistant .continue")).to_be_visible()
    expect(page.locator(".msg.user details.file")).to_have_count(1)
    found = {}
    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        found[scheme] = violations(page)
        if width < 760:
            page.click("#toggle-sidebar")
            page.wait_for_function("document.querySelector('aside').getBoundingClientRect().left >= 0")
            found[f"{scheme}, drawer open"] = violations(page)
            page.keyboard.press("Escape")
            page.wait_for_function("getComputedStyle(document.querySelector('aside')).visibility === 'hidden'")
        else:
            page.click("#open-settings")
            found[f"{scheme}, settings"] = violations(page)
            page.keyboard.press("Escape")
    assert found == {k: [] for k in found}
    assert errors == []
    context.close()
