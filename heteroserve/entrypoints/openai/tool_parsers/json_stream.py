"""Reading a tool call's JSON object while it streams in, so its arguments can go out before the object ends."""

from __future__ import annotations

import json
from enum import Enum

JSON_WHITESPACE = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters", the others "arguments"
_VALUE_STARTS = '{["-0123456789tfnNI'  # NaN and Infinity too, as json.loads accepts them


class ObjectScanner:
    """Follows one JSON object character by character and records where each of its top-level values lies.

    It checks what streaming needs (strings and escapes, nesting, the key-colon-value-comma order, scalars) and
    stops at the object's closing brace, so the text after it stays with the caller. It does not match bracket
    kinds or reject control characters in strings: `json.loads` stays the judge of a finished object. Of a key
    that repeats, the first value counts (`json.loads` keeps the last).
    """

    def __init__(self) -> None:
        self.text = ""  # what it has read: from the start up to the closing brace at most
        self.spans: dict[str, tuple[int, int | None]] = {}  # key -> its value [start, end), end None while open
        self.done = False  # the closing brace has been read
        self.failed = False  # a character that cannot continue a JSON object came; it was not read
        self._expect = "open"  # open, key_or_end, key, colon, value, string, scalar, nested, comma
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._key_start = 0
        self._key = ""
        self._value_start = 0

    def feed(self, chunk: str) -> int:
        """Reads `chunk` up to the object's end or to a character that cannot continue it; returns how much it read."""
        start = len(self.text)
        self.text += chunk
        pos = start
        while pos < len(self.text) and not (self.done or self.failed):
            self._read(pos)
            pos += 1
        if self.failed:
            pos -= 1
        self.text = self.text[:pos]
        return pos - start

    def _read(self, pos: int) -> None:
        char = self.text[pos]
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                self._string_closed(pos)
        elif self._depth > 1:
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._close_value(pos + 1)
        elif self._expect == "scalar" and char not in JSON_WHITESPACE + ",}":
            pass
        else:
            if self._expect == "scalar":
                self._close_value(pos)
            if not (self.failed or char in JSON_WHITESPACE):
                self._read_structure(pos, char)

    def _read_structure(self, pos: int, char: str) -> None:
        expect = self._expect
        if expect == "open" and char == "{":
            self._depth, self._expect = 1, "key_or_end"
        elif expect in ("key_or_end", "key") and char == '"':
            self._in_string, self._key_start = True, pos
        elif expect in ("key_or_end", "comma") and char == "}":
            self.done = True
        elif expect == "colon" and char == ":":
            self._expect = "value"
        elif expect == "value" and char in _VALUE_STARTS:
            self._value_start = pos
            self.spans.setdefault(self._key, (pos, None))
            if char in "{[":
                self._depth, self._expect = 2, "nested"
            elif char == '"':
                self._in_string, self._expect = True, "string"
            else:
                self._expect = "scalar"
        elif expect == "comma" and char == ",":
            self._expect = "key"
        else:
            self.failed = True

    def _string_closed(self, pos: int) -> None:
        if self._expect in ("key_or_end", "key"):
            try:
                self._key = json.loads(self.text[self._key_start : pos + 1])
            except ValueError:
                self.failed = True
            self._expect = "colon"
        elif self._expect == "string":
            self._close_value(pos + 1)

    def _close_value(self, end: int) -> None:
        if self._expect == "scalar":
            try:
                json.loads(self.text[self._value_start : end])
            except ValueError:
                self.failed = True
                return
        if self.spans[self._key][0] == self._value_start:
            self.spans[self._key] = (self._value_start, end)
        self._expect = "comma"


class CallStatus(Enum):
    PENDING = "pending"  # it cannot tell yet
    CALL = "call"  # it is a call, whatever follows
    INVALID = "invalid"  # it cannot be a call


class CallReader:
    """Decides, while a `{"name": ..., "arguments": {...}}` object streams in, whether it is a tool call.

    It is one once its name is a finished string and its arguments have begun as an object (or the object ended
    without arguments, meaning `{}`, unless `arguments_required`): a well-formed rest of the object can no longer
    change that verdict. The verdict never changes afterwards; `broken` tells that the text stopped being JSON
    after it.
    """

    def __init__(self, arguments_required: bool = False) -> None:
        self.scanner = ObjectScanner()
        self.status = CallStatus.PENDING
        self.name: str | None = None
        self.arguments_required = arguments_required

    def feed(self, chunk: str) -> int:
        """Reads `chunk` up to the object's end (or a character that cannot continue it); returns how much it read."""
        read = self.scanner.feed(chunk)
        if self.status is CallStatus.PENDING:
            self.status = self._judge()
        return read

    @property
    def done(self) -> bool:
        return self.scanner.done

    @property
    def broken(self) -> bool:
        return self.scanner.failed

    @property
    def arguments(self) -> str:
        """The arguments' JSON text as far as it has arrived; `{}` for an object that ended without arguments."""
        span = self._arguments_span()
        if span is None:
            return "{}" if self.scanner.done else ""
        return self.scanner.text[span[0] : span[1]]

    def _arguments_span(self) -> tuple[int, int | None] | None:
        spans = self.scanner.spans
        return next((spans[key] for key in spans if key in ARGUMENT_KEYS), None)

    def _judge(self) -> CallStatus:
        scanner = self.scanner
        if scanner.failed:
            return CallStatus.INVALID
        name_span = scanner.spans.get("name")
        if self.name is None and name_span is not None and name_span[1] is not None:
            try:
                name = json.loads(scanner.text[name_span[0] : name_span[1]])
            except ValueError:
                return CallStatus.INVALID
            if not isinstance(name, str):
                return CallStatus.INVALID
            self.name = name
        arguments = self._arguments_span()
        if arguments is not None and scanner.text[arguments[0]] != "{":
            return CallStatus.INVALID
        if scanner.done and (self.name is None or (arguments is None and self.arguments_required)):
            return CallStatus.INVALID
        if self.name is not None and (arguments is not None or scanner.done):
            return CallStatus.CALL
        return CallStatus.PENDING


class ArgumentsReader(CallReader):
    """Follows a bare arguments object whose function name came before it (Mistral's `name[ARGS]{...}`).

    It is a call as soon as the object's opening brace arrives.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    @property
    def arguments(self) -> str:
        return self.scanner.text.lstrip(JSON_WHITESPACE)

    def _judge(self) -> CallStatus:
        if self.arguments:
            return CallStatus.CALL
        return CallStatus.INVALID if self.scanner.failed else CallStatus.PENDING
