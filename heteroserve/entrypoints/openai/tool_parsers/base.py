"""Tool calls as the OpenAI API returns them, and the parser interface each model's tool-call format implements."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from uuid import uuid4

from heteroserve.entrypoints.openai.tool_parsers.json_stream import ARGUMENT_KEYS, CallReader, CallStatus
from heteroserve.entrypoints.openai.tool_parsers.stream_text import Trimmer, partial_marker_len


@dataclass
class ToolCall:
    """One function call the model made; `arguments` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    """A finished output split into its calls and the text outside them (stripped; None when nothing is left)."""

    content: str | None
    tool_calls: list[ToolCall]


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid4().hex}"


def call_from_object(value: object, arguments_required: bool = False) -> ToolCall | None:
    """The call a decoded `{"name": ..., "arguments": {...}}` object stands for, or None when it is not one.

    The arguments are the first of the `ARGUMENT_KEYS` the object holds, and must be an object; without any the
    call takes none (`{}`) unless `arguments_required`. This is the rule `CallReader` applies while the object
    streams in.
    """
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((key for key in value if key in ARGUMENT_KEYS), None)
    if key is None and arguments_required:
        return None
    arguments = {} if key is None else value[key]
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_tool_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream(ABC):
    """Turns one streamed output into chat-completion-chunk deltas: content, and tool calls piece by piece.

    A call opens with one delta holding its index, id, type and name (arguments ""), then its arguments follow
    as fragments that concatenate to their JSON text. Content comes out stripped at the ends of the whole
    output, as `ExtractedToolCalls.content`. Subclasses read one format: they take text from `_pending` as their
    current state (`_state`, a method that returns False when it needs more text) allows, keep text that may
    still turn out to be content in `_held`, and report through `_emit_content` and `_forward`.
    """

    def __init__(self) -> None:
        self.tool_calls: list[ToolCall] = []  # the calls seen so far, their arguments as far as they have arrived
        self._deltas: list[dict] = []
        self._content = Trimmer()
        self._open_reader: CallReader | None = None
        self._pending = ""  # text received but not read yet
        self._held = ""  # text read that is neither content nor part of a call yet
        self._state: Callable[[], bool] = self._read_content

    def feed(self, delta_text: str) -> list[dict]:
        """The deltas to send for the next piece of the output."""
        self._read(delta_text)
        return self._take()

    def finish(self) -> list[dict]:
        """The deltas left when the output ends: text held back in case it began a marker, a call's last piece."""
        self._flush()
        return self._take()

    def _read(self, text: str) -> None:
        self._pending += text
        while self._pending and self._state():
            pass

    @abstractmethod
    def _read_content(self) -> bool:
        """Reads plain text up to the next call; the state every stream starts in."""

    @abstractmethod
    def _flush(self) -> None:
        """Reports what is still held or pending at the end of the output."""

    def _emit_content_before(self, marker: str) -> bool:
        """Sends pending text up to `marker` as content, and takes the marker; False (holding a possible partial
        marker back) when the marker has not arrived."""
        start = self._pending.find(marker)
        if start < 0:
            keep = partial_marker_len(self._pending, marker)
            self._emit_content(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            return False
        self._emit_content(self._pending[:start])
        self._pending = self._pending[start + len(marker) :]
        return True

    def _hold(self, size: int) -> None:
        self._held += self._pending[:size]
        self._pending = self._pending[size:]

    def _read_object(self, reader: CallReader) -> CallStatus:
        """Feeds pending text to `reader` and forwards what it learns; a call's own text stops being held."""
        self._hold(reader.feed(self._pending))
        self._forward(reader)
        if reader.status is CallStatus.CALL:
            self._held = ""
        return reader.status

    def _emit_content(self, text: str) -> None:
        text = self._content.push(text)
        if not text:
            return
        if self._deltas and "content" in self._deltas[-1]:
            self._deltas[-1]["content"] += text
        else:
            self._deltas.append({"content": text})

    def _forward(self, reader: CallReader) -> None:
        """Sends what `reader` learned since last time: the call's opening delta once, then new argument text."""
        if reader.status is not CallStatus.CALL:
            return
        if reader is not self._open_reader:
            self._open_reader = reader
            call = ToolCall(new_tool_call_id(), reader.name or "", "")
            self.tool_calls.append(call)
            self._deltas.append({"tool_calls": [{"index": len(self.tool_calls) - 1, **call.to_openai()}]})
        call, index = self.tool_calls[-1], len(self.tool_calls) - 1
        fragment = reader.arguments[len(call.arguments) :]
        if not fragment:
            return
        call.arguments += fragment
        last = self._deltas[-1]["tool_calls"][0] if self._deltas and "tool_calls" in self._deltas[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            self._deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})

    def _take(self) -> list[dict]:
        deltas, self._deltas = self._deltas, []
        return deltas


class ToolParser(ABC):
    """Reads one model family's tool-call format out of generated text, whole or streamed.

    `tools` are the request's tools (OpenAI's `{"type": "function", "function": {...}}` dicts), for formats whose
    arguments are read by their parameters' schema; JSON formats ignore them."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a finished output and the content around them; text that is not a valid call is content."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A reader for one output arriving in pieces."""

    @classmethod
    def template_messages(cls, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """The history (template messages: OpenAI roles, `tool_calls` with arguments as objects) in the form the
        model's chat template reads past calls and results in; as it is by default. A history the form cannot
        express is a ValueError that names the message."""
        return messages
