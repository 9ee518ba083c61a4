"""Tool calling's request side: `tools`, `tool_choice`, the history's tool calls as chat templates take them, and
the JSON schema that makes `tool_choice` "required" or a named function produce valid calls."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from heteroserve.entrypoints.openai.errors import APIError


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
    `tojson`; a JSON string there would be encoded twice)."""
    converted = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError as exc:
            raise APIError(
                400, f"tool call {call.id}: arguments are not valid JSON ({exc})", "messages.tool_calls"
            ) from exc
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
    return tool.function.parameters or {"type": "object"}


def required_calls_schema(tools: list[ChatTool], parallel: bool) -> dict:
    """A JSON array of one call or more (exactly one unless parallel calls are allowed), each naming one of the
    tools with arguments valid under that tool's parameters."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": arguments_schema(tool)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema
