"""Structured outputs (guided decoding): constraints, their grammars, and the per-request matchers."""

from heteroserve.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
