"""GLM-4.5 / GLM-4.6 tool calls: `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`.

Blocks may repeat and content may surround them. Each argument's value is text: it stays the string it is when
the function's parameter schema says the argument is a string (or a string enum), and is read as JSON otherwise
(text that is not JSON stays a string); that is the inverse of the model's chat template, which writes strings as
they are and everything else with `tojson`. Without the request's tools every value that is JSON is read as JSON.

A `<tool_call>` is a call when a name (letters, digits, `_`, `.`, `-`) follows it, then only key/value pairs and
whitespace up to `</tool_call>`; an unterminated last block (the output hit max_tokens) counts too when it holds at
least one whole pair and nothing after it but whitespace. Otherwise the marker is content, and reading goes on
right after it.

Streaming opens a call once its first key is followed by `<arg_value>` (or its name by `</tool_call>`), then sends each
argument as its `</arg_value>` arrives, as pieces of the arguments' JSON text. The stream cannot take back a call
it opened: when the block stops following the format after that, the call is closed with the arguments it has
and the rest is content, while `extract` reports that block as content.
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
    new_tool_call_id,
)
from heteroserve.entrypoints.openai.tool_parsers.json_stream import CallStatus

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
_NAME = re.compile(r"[\w.\-]+")
_WHITESPACE = re.compile(r"\s*")
# A key ends at the first `</arg_key>`, a value at the first `</arg_value>`, as the stream reads them.
_PAIR = re.compile(r"<arg_key>((?:(?!</arg_key>).)*)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)
# JSON values by the schema type that admits them.
_JSON_TYPES = {"null": (type(None),), "boolean": (bool,), "integer": (int,), "number": (int, float), "array": (list,)}


class Glm45ToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls, pos, search = [], [], 0, 0
        while (start := text.find(OPEN, search)) >= 0:
            search = start + len(OPEN)
            parsed = self._parse_call(text, search)
            if parsed is not None:
                content.append(text[pos:start])
                calls.append(parsed[0])
                pos = search = parsed[1]
        content.append(text[pos:])
        return ExtractedToolCalls("".join(content).strip() or None, calls)

    def stream(self) -> ToolCallStream:
        return Glm45Stream(self.argument_value)

    def _parse_call(self, text: str, pos: int) -> tuple[ToolCall, int] | None:
        """The call written at `pos`, just after a `<tool_call>`, and where it ends; None when there is none."""
        name = _NAME.match(text, pos)
        if name is None:
            return None
        pos = _WHITESPACE.match(text, name.end()).end()
        arguments = {}
        while pair := _PAIR.match(text, pos):
            key = pair.group(1).strip()
            arguments[key] = self.argument_value(name.group(), key, pair.group(2))
            pos = pair.end()
        if text.startswith(CLOSE, pos):
            pos += len(CLOSE)
        elif pos < len(text) or not arguments:
            return None
        return ToolCall(new_tool_call_id(), name.group(), json.dumps(arguments, ensure_ascii=False)), pos

    def argument_value(self, function: str, key: str, text: str) -> object:
        """An argument as the model wrote it, read as its parameter's schema says (see the module's docstring)."""
        schema = parameter_schema(self.tools, function, key)
        if is_text(schema):
            return text
        try:
            value = json.loads(text, parse_constant=_refuse)
        except (ValueError, RecursionError):
            return text
        kinds = schema.get("type") if schema is not None else None
        if isinstance(kinds, list) and "string" in kinds and not _admits(kinds, value):
            return text  # a string that looks like JSON of a type the parameter does not take
        return value


def parameter_schema(tools: list[dict] | None, function: str, key: str) -> dict | None:
    for tool in tools or []:
        spec = tool.get("function", tool)
        if spec.get("name") == function:
            properties = (spec.get("parameters") or {}).get("properties") or {}
            schema = properties.get(key)
            return schema if isinstance(schema, dict) else None
    return None


def is_text(schema: dict | None) -> bool:
    """The parameter takes only strings: type "string", or no type and an enum of strings."""
    if schema is None:
        return False
    kind, enum = schema.get("type"), schema.get("enum")
    if kind is None and isinstance(enum, list) and enum:
        return all(isinstance(value, str) for value in enum)
    return kind == "string" or kind == ["string"]


def _admits(kinds: list, value: object) -> bool:
    if isinstance(value, dict):
        return "object" in kinds
    if isinstance(value, bool):
        return "boolean" in kinds
    return any(isinstance(value, _JSON_TYPES.get(kind, ())) for kind in kinds if kind != "boolean")


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


class OpenCall:
    """The call being streamed, as `ToolCallStream._forward` reads a reader: its name and arguments so far."""

    status = CallStatus.CALL

    def __init__(self, name: str) -> None:
        self.name = name
        self.arguments = ""


class Glm45Stream(ToolCallStream):
    """Content; after each `<tool_call>`, a name, then key/value pairs, each sent once its value is complete."""

    def __init__(self, argument_value: Callable[[str, str, str], object]) -> None:
        super().__init__()
        self._argument_value = argument_value
        self._call: OpenCall | None = None  # the call this block opened, once it has
        self._name = self._key = ""

    def _read_content(self) -> bool:
        if not self._emit_content_before(OPEN):
            return False
        self._held, self._call, self._state = "", None, self._read_name
        return True

    def _read_name(self) -> bool:
        name = _NAME.match(self._pending)
        if name is None:
            return self._fail()
        if name.end() == len(self._pending):
            return False
        self._name = name.group()
        self._hold(name.end())
        self._state = self._read_marker
        return True

    def _read_marker(self) -> bool:
        """Between pairs: whitespace, then the next key, or the block's end."""
        self._hold(_WHITESPACE.match(self._pending).end())
        if self._pending.startswith(KEY_OPEN):
            self._hold(len(KEY_OPEN))
            self._state = self._read_key
        elif self._pending.startswith(CLOSE):
            self._hold(len(CLOSE))
            self._open()
            self._close()
        else:
            return False if KEY_OPEN.startswith(self._pending) or CLOSE.startswith(self._pending) else self._fail()
        return True

    def _read_key(self) -> bool:
        end = self._pending.find(KEY_CLOSE)
        if end < 0:
            return False
        self._key = self._pending[:end].strip()
        self._hold(end + len(KEY_CLOSE))
        self._state = self._read_value_open
        return True

    def _read_value_open(self) -> bool:
        self._hold(_WHITESPACE.match(self._pending).end())
        if self._pending.startswith(VALUE_OPEN):
            self._hold(len(VALUE_OPEN))
            self._open()
            self._state = self._read_value
            return True
        return False if VALUE_OPEN.startswith(self._pending) else self._fail()

    def _read_value(self) -> bool:
        end = self._pending.find(VALUE_CLOSE)
        if end < 0:
            return False
        call = self._call
        value = self._argument_value(call.name, self._key, self._pending[:end])
        self._hold(end + len(VALUE_CLOSE))
        pair = f"{json.dumps(self._key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        call.arguments += ("{" if not call.arguments else ", ") + pair
        self._forward(call)
        self._state = self._read_marker
        return True

    def _open(self) -> None:
        if self._call is None:
            self._call = OpenCall(self._name)
            self._forward(self._call)

    def _close(self) -> None:
        """Ends the open call's arguments object; what follows is content again."""
        self._call.arguments += "}" if self._call.arguments else "{}"
        self._forward(self._call)
        self._held, self._call, self._state = "", None, self._read_content

    def _fail(self) -> bool:
        """The block does not follow the format (or no longer does): an open call ends with the arguments it has,
        and the text after the marker is read again as content, with the marker itself when no call opened."""
        if self._call is not None:
            self._close()
            return True
        self._emit_content(OPEN)
        self._pending, self._held, self._state = self._held + self._pending, "", self._read_content
        return True

    def _flush(self) -> None:
        while self._state != self._read_content:
            if self._call is not None and self._call.arguments:  # cut off after a whole pair: still a call
                self._pending = ""
                self._close()
            else:
                self._fail()
                self._read("")
        self._emit_content(self._pending)
        self._pending = ""
