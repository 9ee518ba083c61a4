"""Mistral tool calls: `[TOOL_CALLS]` then a JSON array `[{"name": ..., "arguments": {...}}, ...]` (older models),
or `[TOOL_CALLS]name[ARGS]{...}` once per call (newer ones).

Content may come before, between and after. A `[TOOL_CALLS]` whose text does not parse as calls (the whole array
must) is content, and reading goes on right after it.

Streaming forwards a call's arguments as their JSON arrives: an array item's once its name is known and its
arguments have begun (see `CallReader`), a `name[ARGS]` call's from its opening brace. Until the first call of a
`[TOOL_CALLS]` opens, its text is held back, so text that cannot be calls streams as content as `extract` reports
it. The stream cannot take back a call it opened: when the JSON breaks or stops after that, the calls stay in the
stream (what follows the break is content), while `extract` reports that `[TOOL_CALLS]` and its text as content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from heteroserve.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_from_object,
    new_tool_call_id,
)
from heteroserve.entrypoints.openai.tool_parsers.json_stream import ArgumentsReader, CallReader, CallStatus

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NAME = re.compile(r"[\w.-]*")


class MistralToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls, pos, search = [], [], 0, 0
        while (start := text.find(MARKER, search)) >= 0:
            search = start + len(MARKER)
            parsed = _parse_calls(text, search)
            if parsed is not None:
                content.append(text[pos:start])
                calls += parsed[0]
                pos = search = parsed[1]
        content.append(text[pos:])
        return ExtractedToolCalls("".join(content).strip() or None, calls)

    def stream(self) -> ToolCallStream:
        return MistralStream()


def _parse_calls(text: str, pos: int) -> tuple[list[ToolCall], int] | None:
    """The calls written at `pos`, just after a `[TOOL_CALLS]`, and where they end; None when there are none."""
    decoder = json.JSONDecoder()
    pos = _WHITESPACE.match(text, pos).end()
    try:
        if text.startswith("[", pos):
            items, end = decoder.raw_decode(text, pos)
            calls = [call_from_object(item) for item in items]
            return None if any(call is None for call in calls) else (calls, end)
        name = _NAME.match(text, pos)
        start = _WHITESPACE.match(text, name.end() + len(ARGS)).end()
        if not (name.group() and text.startswith(ARGS, name.end()) and text.startswith("{", start)):
            return None
        arguments, end = decoder.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None
    return [ToolCall(new_tool_call_id(), name.group(), json.dumps(arguments, ensure_ascii=False))], end


class MistralStream(ToolCallStream):
    """Content; after each `[TOOL_CALLS]`, an array read item by item or a name and its arguments object."""

    def __init__(self) -> None:
        super().__init__()
        self._reader = CallReader()
        self._committed = False  # a call after the current [TOOL_CALLS] has opened
        self._array_expects = "first"  # in an array: "first" (an item or "]"), "item", or "separator" ("," or "]")

    def _read_content(self) -> bool:
        if not self._emit_content_before(MARKER):
            return False
        self._committed, self._state = False, self._read_marker
        return True

    def _read_marker(self) -> bool:
        self._hold(_WHITESPACE.match(self._pending).end())
        if not self._pending:
            return False
        if self._pending[0] == "[":
            self._hold(1)
            self._array_expects, self._state = "first", self._read_array
        else:
            self._state = self._read_name
        return True

    def _read_name(self) -> bool:
        name = _NAME.match(self._pending)
        rest = self._pending[name.end() :]
        if not (name.group() and (rest.startswith(ARGS) or ARGS.startswith(rest))):
            return self._fail()
        if not rest.startswith(ARGS):
            return False
        self._hold(name.end() + len(ARGS))
        self._reader, self._state = ArgumentsReader(name.group()), self._read_arguments
        return True

    def _read_array(self) -> bool:
        self._hold(_WHITESPACE.match(self._pending).end())
        if not self._pending:
            return False
        char, expects = self._pending[0], self._array_expects
        if char == "]" and expects != "item":
            self._hold(1)
            self._held, self._state = "", self._read_content
        elif char == "{" and expects != "separator":
            self._reader, self._array_expects, self._state = CallReader(), "separator", self._read_item
        elif char == "," and expects == "separator":
            self._hold(1)
            self._array_expects = "item"
        else:
            return self._fail()
        return True

    def _read_item(self) -> bool:
        return self._read_call(self._read_array)

    def _read_arguments(self) -> bool:
        return self._read_call(self._read_content)

    def _read_call(self, after: Callable[[], bool]) -> bool:
        status = self._read_object(self._reader)
        if status is CallStatus.INVALID:
            return self._fail()
        self._committed = self._committed or status is CallStatus.CALL
        if self._reader.done:
            self._state = after
            return True
        if self._reader.broken:
            self._state = self._read_content
            return True
        return False

    def _fail(self) -> bool:
        """The text after `[TOOL_CALLS]` is not (or no longer) calls: it is content, read again for markers, and so
        is the marker itself when none of its calls opened."""
        if not self._committed:
            self._emit_content(MARKER)
        self._pending, self._held, self._state = self._held + self._pending, "", self._read_content
        return True

    def _flush(self) -> None:
        while self._state != self._read_content:
            if self._committed:  # a call cut off: the stream has sent it already
                self._pending, self._held, self._state = "", "", self._read_content
            else:
                self._fail()
                self._read("")
        self._emit_content(self._pending)
        self._pending = ""
