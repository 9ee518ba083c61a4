"""GLM-4 tool calls (GLM-4-0414, glm-4-9b-chat): `NAME\\n{"arg": ...}`, the function's name on a line of its own at
the start of the answer, then the arguments as one JSON object.

The checkpoints' templates write a call back as `<|assistant|>NAME\\n{...}` (GLM-4-0414's with a space before the
newline) from an assistant turn whose `metadata` is the name, and its result as an `<|observation|>` turn; the model
ends a call with `<|observation|>`, so a call is what the output opens with. Several may follow one another, each
after optional whitespace and an optional `<|assistant|>` (the marker is there when special tokens are not
skipped). Reading stops at the first text that is not a call: it, and everything after it, is content. A call is a
name (letters, digits, `_`, `.`, `-`), optional spaces or tabs, a newline, optional whitespace, then an object that
decodes as JSON whole; with the request's tools the name must be one of theirs, so an answer that merely starts
with a word and a JSON object stays content.

The arguments are JSON already; the function's parameter schema (`glm45`'s rule) only retypes what the model
wrote as the wrong kind: a string holding JSON of a type the parameter takes becomes that value, and a number
given to a parameter that takes only strings becomes its JSON text. Without the request's tools they stay as
written.

Streaming opens a call when its object's `{` arrives after a name line, then sends each top-level argument once
its value is complete, as pieces of the arguments' JSON text. The stream cannot take back a call it opened: when
the object breaks or stops (max_tokens) after that, the call closes with the arguments it has and the rest is
content, while `extract` reports that text as content.

A history reaches the templates in their own form, since they drop OpenAI's `tool_calls` and `tool` turns: an
assistant turn's text (when it has any) stays a turn of its own, then each call becomes an assistant turn whose
`metadata` is the name and whose content is the arguments' JSON, followed by its result as an `observation` turn
(the tool turn answering it: by `tool_call_id`, else the first call not answered yet), as the model writes one call
and stops at `<|observation|>`. The request's tools go on the first turn as `tools` too, where glm-4-9b-chat's
template reads them (GLM-4-0414's reads the `tools` variable and ignores the key). A tool turn that answers no call
of the assistant turn before it cannot be written in this form, and is a ValueError.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from enum import Enum

from heteroserve.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
    new_tool_call_id,
)
from heteroserve.entrypoints.openai.tool_parsers.glm45 import (
    Glm45ToolParser,
    OpenCall,
    is_text,
    parameter_schema,
)
from heteroserve.entrypoints.openai.tool_parsers.json_stream import JSON_WHITESPACE, ObjectScanner

MARKER = "<|assistant|>"
_NAME = re.compile(r"[\w.\-]+")


class _Line(Enum):
    PENDING = "pending"  # the text so far may still become a call's name line
    CALL = "call"  # a name line, and the `{` of its arguments
    INVALID = "invalid"  # it cannot


class Glm4ToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while True:
            verdict, name, start = _name_line(text[pos:], self._names())
            if verdict is not _Line.CALL:
                break
            try:
                arguments, end = decoder.raw_decode(text, pos + start)
            except (ValueError, RecursionError):
                break
            typed = {key: self.argument_value(name, key, value) for key, value in arguments.items()}
            calls.append(ToolCall(new_tool_call_id(), name, json.dumps(typed, ensure_ascii=False)))
            pos = end
        return ExtractedToolCalls(text[pos:].strip() or None, calls)

    def stream(self) -> ToolCallStream:
        return Glm4Stream(self._names(), self.argument_value)

    def argument_value(self, function: str, key: str, value: object) -> object:
        """An argument the model wrote as JSON, retyped as its parameter's schema says (see the module's docstring)."""
        schema = parameter_schema(self.tools, function, key)
        if schema is None:
            return value
        if isinstance(value, str):
            return Glm45ToolParser(self.tools).argument_value(function, key, value)
        if is_text(schema) and isinstance(value, int | float) and not isinstance(value, bool):
            return json.dumps(value)
        return value

    def _names(self) -> set[str] | None:
        if not self.tools:
            return None
        return {tool.get("function", tool).get("name") for tool in self.tools}

    @classmethod
    def template_messages(cls, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """The history in GLM-4's own form (see the module's docstring)."""
        turns, index = [], 0
        while index < len(messages):
            message = messages[index]
            if message["role"] == "tool":
                raise ValueError(
                    f"messages[{index}] is a tool message that follows no assistant message with tool_calls: "
                    "GLM-4's chat template writes a tool's result only after the call it answers"
                )
            end = index + 1
            if message["role"] == "assistant" and message.get("tool_calls"):
                while end < len(messages) and messages[end]["role"] == "tool":
                    end += 1
                turns += _call_turns(message, index, messages[index + 1 : end])
            else:
                turns.append(message)
            index = end
        if tools and turns:
            turns[0] = {**turns[0], "tools": tools}
        return turns


def _call_turns(message: dict, index: int, results: list[dict]) -> list[dict]:
    """`messages[index]`, an assistant message with tool calls, and the tool messages after it (`results`) as
    GLM-4 turns: its text, then each call followed by the result answering it."""
    calls = message["tool_calls"]
    answers: list[dict | None] = [None] * len(calls)
    for offset, result in enumerate(results, index + 1):
        call_id = result.get("tool_call_id")
        waiting = [n for n, call in enumerate(calls) if answers[n] is None and call_id in (None, call.get("id"))]
        if waiting:
            answers[waiting[0]] = result
        elif call_id is None:
            raise ValueError(
                f"messages[{offset}] is a tool message without tool_call_id, and every call of messages[{index}] "
                "is answered already"
            )
        elif any(call.get("id") == call_id for call in calls):
            raise ValueError(f"messages[{offset}] answers call {call_id!r} of messages[{index}] a second time")
        else:
            raise ValueError(f"messages[{offset}] answers call {call_id!r}, which messages[{index}] does not make")
    text = message.get("content")
    has_text = text.strip() if isinstance(text, str) else bool(text)
    turns = [{"role": "assistant", "content": text}] if has_text else []
    for call, answer in zip(calls, answers, strict=True):
        arguments = call["function"]["arguments"]
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        turns.append({"role": "assistant", "metadata": call["function"]["name"], "content": arguments})
        if answer is not None:
            turns.append({"role": "observation", "content": answer["content"]})
    # What else the message held (reasoning_content, ...) stays on its first turn; the templates ignore it.
    turns[0].update({key: value for key, value in message.items() if key not in ("role", "content", "tool_calls")})
    return turns


def _name_line(text: str, names: set[str] | None) -> tuple[_Line, str, int]:
    """Whether `text` opens with a call's name line (see the module's docstring), its name, and where the
    arguments' `{` is."""
    pos = len(text) - len(text.lstrip(JSON_WHITESPACE))
    if text.startswith(MARKER, pos):
        pos += len(MARKER)
    elif pos < len(text) and MARKER.startswith(text[pos:]):
        return _Line.PENDING, "", 0
    name = _NAME.match(text, pos)
    if name is None:
        return (_Line.INVALID if pos < len(text) else _Line.PENDING), "", 0
    if names is not None and not any(known.startswith(name.group()) for known in names):
        return _Line.INVALID, "", 0  # no tool's name: content at once, without waiting for the line's end
    pos = name.end()
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    if pos == len(text):
        return _Line.PENDING, "", 0
    if text[pos] != "\n" or (names is not None and name.group() not in names):
        return _Line.INVALID, "", 0
    pos += 1
    while pos < len(text) and text[pos] in JSON_WHITESPACE:
        pos += 1
    if pos == len(text):
        return _Line.PENDING, "", 0
    return (_Line.CALL, name.group(), pos) if text[pos] == "{" else (_Line.INVALID, "", 0)


class Glm4Stream(ToolCallStream):
    """Name lines and their arguments objects while they last, then content to the end."""

    def __init__(self, names: set[str] | None, argument_value: Callable[[str, str, object], object]) -> None:
        super().__init__()
        self._names = names
        self._argument_value = argument_value
        self._call: OpenCall | None = None
        self._scanner = ObjectScanner()
        self._sent: set[str] = set()  # the arguments of the open call already sent
        self._state = self._read_name_line

    def _read_content(self) -> bool:
        self._emit_content(self._pending)
        self._pending = ""
        return False

    def _read_name_line(self) -> bool:
        text = self._held + self._pending
        verdict, name, start = _name_line(text, self._names)
        if verdict is _Line.PENDING:
            self._held, self._pending = text, ""
            return False
        if verdict is _Line.INVALID:
            self._held, self._pending, self._state = "", text, self._read_content
            return True
        self._held, self._pending = "", text[start:]
        self._call, self._scanner, self._sent = OpenCall(name), ObjectScanner(), set()
        self._forward(self._call)
        self._state = self._read_arguments
        return True

    def _read_arguments(self) -> bool:
        self._pending = self._pending[self._scanner.feed(self._pending) :]
        if not self._send_arguments():
            return True
        if self._scanner.done:
            self._close(self._read_name_line)
            return True
        if self._scanner.failed:
            self._close(self._read_content)
            return True
        return False

    def _send_arguments(self) -> bool:
        """Sends the arguments whose values have ended; False (the call closed, the rest content) when one is not
        JSON after all."""
        call, text = self._call, self._scanner.text
        for key, (start, end) in self._scanner.spans.items():
            if end is None or key in self._sent:
                continue
            try:
                value = self._argument_value(call.name, key, json.loads(text[start:end]))
            except (ValueError, RecursionError):
                self._close(self._read_content)
                return False
            self._sent.add(key)
            pair = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
            call.arguments += ("{" if not call.arguments else ", ") + pair
            self._forward(call)
        return True

    def _close(self, then: Callable[[], bool]) -> None:
        self._call.arguments += "}" if self._call.arguments else "{}"
        self._forward(self._call)
        self._call, self._state = None, then

    def _flush(self) -> None:
        if self._state == self._read_arguments:  # cut off: the stream has opened the call already
            self._close(self._read_content)
        self._emit_content(self._held + self._pending)
        self._held = self._pending = ""
