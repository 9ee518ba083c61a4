"""Tool calling's request side: `tools`, `tool_choice`, the history's tool calls as chat templates take them, and
the constraint that makes `tool_choice` "required" or a named function produce valid calls.

A function's `strict` is OpenAI's: true asks that every keyword of its parameters be enforced (a keyword the
grammar engine cannot enforce is a 400); false or absent skips those keywords and enforces the rest, as
`response_format` does. A function without `parameters` takes no arguments (`{}`), as OpenAI reads it."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.structured_output import StructuredOutputsParams
from heteroserve.structured_output.ascii_classes import DATA_KEYWORDS
from heteroserve.structured_output.grammar_compiler import check_strict_schema


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(BaseModel):
    """A tool call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def template_tool_calls(calls: list[AssistantToolCall]) -> list[dict]:
    """The history's tool calls as chat templates take them: arguments as an object (templates write it with
    `tojson`; a JSON string there would be encoded twice). Arguments that are not JSON stay the string they are,
    as OpenAI passes them on."""
    converted = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = call.function.arguments
        converted.append(
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        )
    return converted


def named_function(tools: list[ChatTool], choice: NamedToolChoice) -> ChatTool:
    for tool in tools:
        if tool.function.name == choice.function.name:
            return tool
    raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")


def arguments_schema(tool: ChatTool) -> dict:
    if tool.function.parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return tool.function.parameters


def forced_calls_params(tools: list[ChatTool], choice: NamedToolChoice | Literal["required"], parallel: bool):
    """The constraint of a forced tool call: the named function's arguments, or the calls `required_calls_schema`
    describes. Lenient unless every function involved is strict; a strict one among lenient ones is checked on
    its own, so its unenforceable keywords are still a 400."""
    chosen = [named_function(tools, choice)] if choice != "required" else tools
    strict = [tool for tool in chosen if tool.function.strict]
    if len(strict) < len(chosen):
        for tool in strict:
            try:
                check_strict_schema(arguments_schema(tool))
            except ValueError as exc:
                raise APIError(400, f"tool {tool.function.name!r} is strict: {exc}", "tools") from exc
    schema = arguments_schema(chosen[0]) if choice != "required" else required_calls_schema(chosen, parallel)
    try:
        return StructuredOutputsParams(json=schema, strict=len(strict) == len(chosen))
    except ValueError as exc:
        raise APIError(400, str(exc), "tools") from exc


def required_calls_schema(tools: list[ChatTool], parallel: bool) -> dict:
    """A JSON array of one call or more (exactly one unless parallel calls are allowed), each naming one of the
    tools with arguments valid under that tool's parameters.

    Each tool's parameters sit whole under `$defs` (`tool_0`, ...) with their own references pointed there, so a
    schema with `$defs` and `$ref` (what pydantic writes for nested models) keeps resolving."""
    calls, definitions = [], {}
    for i, tool in enumerate(tools):
        name = f"tool_{i}"
        definitions[name] = _rebase_refs(arguments_schema(tool), f"#/$defs/{name}")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": {"$ref": f"#/$defs/{name}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "$defs": definitions}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rebase_refs(schema: object, root: str) -> object:
    """`schema` with each local `$ref` ("#", "#/...") made to point under `root`."""
    if isinstance(schema, list):
        return [_rebase_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            rebased[key] = root + value[1:]
        elif key in DATA_KEYWORDS:
            rebased[key] = value
        else:
            rebased[key] = _rebase_refs(value, root)
    return rebased
