"""Tool-call parsers: model output text -> OpenAI tool calls, whole or streamed (vLLM's --tool-call-parser names)."""

from __future__ import annotations

from heteroserve.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from heteroserve.entrypoints.openai.tool_parsers.glm4 import Glm4ToolParser
from heteroserve.entrypoints.openai.tool_parsers.glm45 import Glm45ToolParser
from heteroserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from heteroserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from heteroserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "glm4": Glm4ToolParser,
    "glm45": Glm45ToolParser,
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def tool_parser(name: str) -> type[ToolParser]:
    """The parser class `--tool-call-parser name` selects."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "tool_parser",
]
