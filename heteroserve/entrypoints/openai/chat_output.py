"""A chat choice's generated text as OpenAI deltas: reasoning split off, tool calls found or forced, content.

Streamed and whole answers take the same path: a whole answer is its deltas merged (`merge_deltas`), so the pieces
of a stream always add up to the non-streamed message.
"""

from __future__ import annotations

import json

from heteroserve.entrypoints.openai.reasoning_parsers import reasoning_parser
from heteroserve.entrypoints.openai.tool_parsers import tool_parser
from heteroserve.entrypoints.openai.tool_parsers.base import ToolCall, new_tool_call_id


class NamedCallOutput:
    """tool_choice names a function: the whole output is its arguments (generated under their schema)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def feed(self, text: str) -> list[dict]:
        deltas = []
        if self.calls == 0:
            self.calls = 1
            deltas.append({"tool_calls": [{"index": 0, **ToolCall(new_tool_call_id(), self.name, "").to_openai()}]})
        if text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas

    def finish(self) -> list[dict]:
        return self.feed("") if self.calls == 0 else []


class RequiredCallsOutput:
    """tool_choice "required": the output is a JSON array of {"name", "arguments"} (generated under a schema of
    the tools); the calls go out whole once the array is complete. Text that does not parse (the request ran out
    of tokens) goes out as content."""

    def __init__(self) -> None:
        self.text = ""
        self.calls = 0

    def feed(self, text: str) -> list[dict]:
        self.text += text
        return []

    def finish(self) -> list[dict]:
        try:
            calls = json.loads(self.text)
        except json.JSONDecodeError:
            return [{"content": self.text}] if self.text else []
        self.calls = len(calls)
        found = [ToolCall(new_tool_call_id(), c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
        return [{"tool_calls": [{"index": i, **call.to_openai()}]} for i, call in enumerate(found)]


class AutoCallsOutput:
    """tool_choice "auto": the model decides; the server's --tool-call-parser finds its calls in the text. With
    parallel_tool_calls false, calls after the first are left out. tools: the request's tool definitions (a parser
    whose format writes arguments as text reads their types from the schemas)."""

    def __init__(self, parser_name: str, parallel: bool, tools: list[dict] | None = None) -> None:
        self.stream = tool_parser(parser_name)(tools).stream()
        self.parallel = parallel

    @property
    def calls(self) -> int:
        found = len(self.stream.tool_calls)
        return found if self.parallel else min(found, 1)

    def feed(self, text: str) -> list[dict]:
        return self._allowed(self.stream.feed(text))

    def finish(self) -> list[dict]:
        return self._allowed(self.stream.finish())

    def _allowed(self, deltas: list[dict]) -> list[dict]:
        if self.parallel:
            return deltas
        return [d for d in deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]


class PlainOutput:
    calls = 0

    def feed(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        return []


ToolOutput = NamedCallOutput | RequiredCallsOutput | AutoCallsOutput | PlainOutput


class ChoiceDeltas:
    """One choice's text in, OpenAI `delta` dicts out: reasoning first (with a reasoning parser), the rest through
    the tool-call mode."""

    def __init__(self, tools: ToolOutput, reasoning_parser_name: str | None) -> None:
        self.tools = tools
        self.reasoning = reasoning_parser(reasoning_parser_name).stream() if reasoning_parser_name else None

    def feed(self, text: str) -> list[dict]:
        if self.reasoning is None:
            return self.tools.feed(text)
        return self._route(self.reasoning.feed(text))

    def finish(self) -> list[dict]:
        deltas = self._route(self.reasoning.finish()) if self.reasoning is not None else []
        return deltas + self.tools.finish()

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model stopped after calling tools on its own or as required."""
        if engine_reason == "stop" and self.tools.calls and not isinstance(self.tools, NamedCallOutput):
            return "tool_calls"
        return engine_reason

    def _route(self, deltas: list[dict]) -> list[dict]:
        routed = []
        for delta in deltas:
            if "content" in delta:
                routed.extend(self.tools.feed(delta["content"]))
            else:
                routed.append(delta)
        return routed


def merge_deltas(deltas: list[dict], with_reasoning: bool) -> dict:
    """The assistant message that these deltas stream (`reasoning_content` too when a reasoning parser is set)."""
    content, reasoning = [], []
    calls: dict[int, dict] = {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        for piece in delta.get("tool_calls", []):
            call = calls.setdefault(
                piece["index"], {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
            )
            call["id"] = piece.get("id") or call["id"]
            function = piece.get("function", {})
            call["function"]["name"] = function.get("name") or call["function"]["name"]
            call["function"]["arguments"] += function.get("arguments") or ""
    text = "".join(content)
    message: dict = {"role": "assistant", "content": text if text or not calls else None}
    if with_reasoning:
        message["reasoning_content"] = "".join(reasoning) or None
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
