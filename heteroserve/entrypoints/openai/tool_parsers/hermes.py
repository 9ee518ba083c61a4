"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Blocks may repeat and content may surround them. A block is a call when its text is one JSON object that
`call_from_object` accepts; an unterminated last block (the output hit max_tokens) counts too when its JSON is
complete. Anything else, markers included, is content.

Streaming forwards a call's arguments as their JSON arrives. A block becomes a call as soon as its name is known
and its arguments have begun (see `CallReader`); one that can no longer become a call streams as content at once.
The stream cannot take back a call it opened, so a call whose JSON breaks or stops later (invalid text, max_tokens)
stays a call in the stream while `extract` reports that block as content.
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
from heteroserve.entrypoints.openai.tool_parsers.stream_text import partial_marker_len

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


class HermesToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls, pos = [], [], 0
        for block in _BLOCK.finditer(text):
            call = _decode_call(block.group(1))
            if call is not None:
                content.append(text[pos : block.start()])
                calls.append(call)
                pos = block.end()
        content.append(text[pos:])
        return ExtractedToolCalls("".join(content).strip() or None, calls)

    def stream(self) -> ToolCallStream:
        return HermesStream()


def _decode_call(body: str) -> ToolCall | None:
    try:
        return call_from_object(json.loads(body))
    except (ValueError, RecursionError):
        return None


class HermesStream(ToolCallStream):
    """Content, then for each block the text after `<tool_call>` (held while it may still be a call)."""

    def __init__(self) -> None:
        super().__init__()
        self._reader = CallReader()

    def _read_content(self) -> bool:
        if not self._emit_content_before(OPEN):
            return False
        self._reader, self._held, self._state = CallReader(), "", self._read_block
        return True

    def _read_block(self) -> bool:
        end = self._pending.find(CLOSE)
        size = len(self._pending) - partial_marker_len(self._pending, CLOSE) if end < 0 else end
        self._add_to_block(self._pending[:size])
        self._pending = self._pending[size:]
        if end < 0:
            return False
        self._pending = self._pending[len(CLOSE) :]
        self._end_block(CLOSE)
        return True

    def _add_to_block(self, text: str) -> None:
        if self._reader.status is CallStatus.INVALID:
            self._emit_content(text)
            return
        self._held += text
        self._reader.feed(text)  # it reads no further than the object's end: the rest of a call's block is dropped
        self._forward(self._reader)
        if self._reader.status is CallStatus.INVALID:
            self._emit_content(OPEN + self._held)

    def _end_block(self, close: str) -> None:
        if self._reader.status is CallStatus.PENDING:
            self._emit_content(OPEN + self._held + close)
        elif self._reader.status is CallStatus.INVALID:
            self._emit_content(close)
        self._held, self._state = "", self._read_content

    def _flush(self) -> None:
        if self._state == self._read_block:
            self._add_to_block(self._pending)
            self._end_block("")
        else:
            self._emit_content(self._pending)
        self._pending = ""
