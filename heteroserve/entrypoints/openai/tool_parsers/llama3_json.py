"""Llama 3.1/3.2 JSON tool calls: `{"name": ..., "parameters": {...}}`, several joined by `; `.

The output is calls only when it starts (after whitespace, and an optional `<|python_tag|>`) with `{`; otherwise
it is all content. "arguments" is accepted for "parameters"; one of them must be there, since a JSON answer
may well have a "name". Content starts where the calls stop: at the first
object that is not a call, or at text other than a separator, so an output that does not parse is all content.

Streaming forwards a call's arguments as their JSON arrives, opening the call once its name is known and its
arguments have begun (see `CallReader`). Until then the object is held back, so text that turns out not to be a
call (a JSON answer such as `{"answer": 42}`) streams as content as `extract` reports it. The stream cannot take
back a call it opened: a call whose JSON breaks or stops later stays a call there, while `extract` reports the
text from that call on as content.
"""

from __future__ import annotations

import json
import re

from heteroserve.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_from_object,
)
from heteroserve.entrypoints.openai.tool_parsers.json_stream import CallReader, CallStatus

PYTHON_TAG = "<|python_tag|>"
_PREFIX = re.compile(r"\s*(?:<\|python_tag\|>\s*)?")
_SEPARATOR = re.compile(r"[ \t\n\r]*;?[ \t\n\r]*")


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        content_start = 0
        pos = _PREFIX.match(text).end()
        while text.startswith("{", pos):
            try:
                value, after = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):
                break
            call = call_from_object(value, arguments_required=True)
            if call is None:
                break
            calls.append(call)
            content_start, pos = after, _SEPARATOR.match(text, after).end()
        if calls and pos == len(text):
            content_start = pos  # a separator after the last call is not content
        return ExtractedToolCalls(text[content_start:].strip() or None, calls)

    def stream(self) -> ToolCallStream:
        return Llama3JsonStream()


class Llama3JsonStream(ToolCallStream):
    """Decides from the output's start whether it holds calls, then reads objects and the separators between."""

    def __init__(self) -> None:
        super().__init__()
        self._reader = CallReader()
        self._state = self._read_start

    def _read_start(self) -> bool:
        prefix = _PREFIX.match(self._pending).end()
        rest = self._pending[prefix:]
        if not rest or (PYTHON_TAG.startswith(rest) and PYTHON_TAG not in self._pending[:prefix]):
            return False  # whitespace or a part of the tag: the start is still to come
        self._hold(prefix)
        if rest.startswith("{"):
            self._state = self._read_separator  # an empty one, before the first object
        else:
            self._to_content()
        return True

    def _read_separator(self) -> bool:
        size = _SEPARATOR.match(self._pending).end()
        if size == len(self._pending):
            return False
        if self._pending[size] != "{":
            self._to_content()
            return True
        self._hold(size)
        self._reader, self._state = CallReader(arguments_required=True), self._read_call
        return True

    def _read_call(self) -> bool:
        status = self._read_object(self._reader)
        if status is CallStatus.INVALID or self._reader.broken:
            self._to_content()
            return True
        if self._reader.done:
            self._state = self._read_separator
            return True
        return False

    def _read_content(self) -> bool:
        self._emit_content(self._pending)
        self._pending = ""
        return False

    def _to_content(self) -> None:
        """From here on the output is content, the text held so far included."""
        self._pending, self._held, self._state = self._held + self._pending, "", self._read_content

    def _flush(self) -> None:
        unfinished = self._state == self._read_call and self._reader.status is CallStatus.PENDING
        if self._state == self._read_start or unfinished:
            self._to_content()
        if self._state == self._read_content:
            self._read_content()
