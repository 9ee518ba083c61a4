"""The request fields that ask for structured outputs: OpenAI's `response_format` and vLLM's `structured_outputs`
with its older `guided_*` spellings, turned into one `StructuredOutputsParams`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.structured_output import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` body field: exactly one of these."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredOutputFields(BaseModel):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint these fields ask for (None: free text); 400 when several are given or one is bad."""
        builders = {}
        if self.response_format is not None and self.response_format.type != "text":
            builders["response_format"] = lambda: self._from_response_format(self.response_format)
        if self.structured_outputs is not None:
            body = self.structured_outputs
            builders["structured_outputs"] = lambda: StructuredOutputsParams(
                json=body.json_schema,
                regex=body.regex,
                choice=body.choice,
                grammar=body.grammar,
                json_object=body.json_object,
            )
        guided = {
            "guided_json": ("json", self.guided_json),
            "guided_regex": ("regex", self.guided_regex),
            "guided_choice": ("choice", self.guided_choice),
            "guided_grammar": ("grammar", self.guided_grammar),
        }
        for name, (kind, value) in guided.items():
            if value is not None:
                builders[name] = lambda kind=kind, value=value: StructuredOutputsParams(**{kind: value})
        if len(builders) > 1:
            raise APIError(400, f"give one structured output constraint, not several ({', '.join(builders)})")
        for name, build in builders.items():
            try:
                return build()
            except ValueError as exc:
                raise APIError(400, str(exc), name) from exc
        return None

    @staticmethod
    def _from_response_format(response_format: ResponseFormat) -> StructuredOutputsParams:
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format.json_schema")
        return StructuredOutputsParams(json=spec.json_schema, strict=bool(spec.strict))
