"""`\\d`, `\\w` and `\\s` in structured-output regexes as ASCII classes, as developers mean them and as JSON Schema's
ECMA-262 `pattern` reads `\\d` and `\\w`.

llguidance reads regexes with Unicode classes: `\\d{3}` there admits '🯸🯸🯸' (U+1FBF8 is a decimal digit). vLLM's
default backend (xgrammar) reads them as ASCII; so does every regex and JSON-schema pattern heteroserve passes on.
Lark and GBNF grammars go to the engine as written.
"""

from __future__ import annotations

# In a character class a nested class is a union (regex-syntax's `[a[0-9]]`), so one spelling serves both places.
_CLASSES = {
    "d": "[0-9]",
    "D": "[^0-9]",
    "w": "[0-9A-Za-z_]",
    "W": "[^0-9A-Za-z_]",
    "s": "[\\t\\n\\x0B\\x0C\\r ]",
    "S": "[^\\t\\n\\x0B\\x0C\\r ]",
}
# Keywords whose values map names to subschemas (the names are not keywords).
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
# Keywords whose values are data, not schemas: a walk through a schema leaves them as they are.
DATA_KEYWORDS = ("enum", "const", "default", "examples")


def ascii_regex(pattern: str) -> str:
    """`pattern` with each `\\d \\D \\w \\W \\s \\S` written as its ASCII class; every other escape kept."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            escape = pattern[i + 1]
            out.append(_CLASSES.get(escape, "\\" + escape))
            i += 2
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


def ascii_schema(schema: object) -> object:
    """A JSON schema with its `pattern` and `patternProperties` regexes made ASCII (a copy; the input is kept)."""
    if isinstance(schema, list):
        return [ascii_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            converted[key] = ascii_regex(value)
        elif key == "patternProperties" and isinstance(value, dict):
            converted[key] = {ascii_regex(name): ascii_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            converted[key] = {name: ascii_schema(sub) for name, sub in value.items()}
        elif key in DATA_KEYWORDS:
            converted[key] = value
        else:
            converted[key] = ascii_schema(value)
    return converted
