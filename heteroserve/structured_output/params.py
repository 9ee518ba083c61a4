"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some strings, or a grammar.

vLLM's `StructuredOutputsParams`, with its field names, so offline scripts port by changing the import. Exactly
one kind is set. The grammar engine reads it in `GrammarCompiler`; this file stays plain Python because the
engine core's `SamplingParams` carries it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (text or parsed)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or llama.cpp's GBNF
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    # A JSON schema keyword the grammar engine cannot enforce is an error (OpenAI's `strict: true`); with False it
    # is skipped and the rest still enforced.
    strict: bool = True

    def __post_init__(self) -> None:
        chosen = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, regex, choice, grammar or json_object; "
                f"got {chosen or 'none'}"
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured outputs: choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured outputs: the JSON schema is not valid JSON: {exc}") from exc
            if not isinstance(parsed, dict | bool):
                raise ValueError("structured outputs: a JSON schema is an object or a boolean")

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    @property
    def cache_key(self) -> tuple[str, str]:
        """The same constraint gives the same key, whichever form (text or dict) it came in."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif self.kind == "choice":
            value = json.dumps(value)
        return self.kind, str(value)
