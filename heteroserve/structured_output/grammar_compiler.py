"""Structured-output constraints compiled to llguidance grammars, validated once and cached.

llguidance is the grammar engine (measured against xgrammar in bench/README.md: compiles a schema in ~1-3 ms
against ~13 ms, computes a mask in ~30 us against ~5 us, both far below a decode step, and it installs without
dependencies where xgrammar pulls triton). It reads JSON schemas, regexes, Lark and GBNF grammars natively.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import llguidance
import llguidance.hf

from heteroserve.structured_output.params import StructuredOutputsParams

# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): a small model that may pad with
# newlines forever under flexible whitespace still ends its object.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Turns `StructuredOutputsParams` into llguidance matchers over one tokenizer's vocabulary."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 512) -> None:
        # The model's vocabulary may be wider than the tokenizer's: masks cover every logit, extra ones disallowed.
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=max(vocab_size, len(hf_tokenizer)), eos_token=eos_token_ids
        )
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[str, str, bool], str] = OrderedDict()
        self._cache_size = cache_size

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The validated llguidance grammar; ValueError naming the problem for a bad schema, regex or grammar."""
        key = (*params.cache_key, params.strict)
        grammar = self._cache.get(key)
        if grammar is not None:
            self._cache.move_to_end(key)
            return grammar
        grammar = self._build(params)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid {params.kind} for structured outputs: {error.strip()}")
        self._cache[key] = grammar
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)

    @staticmethod
    def _build(params: StructuredOutputsParams) -> str:
        options = {**_JSON_OPTIONS, "lenient": not params.strict}
        try:
            if params.json is not None:
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            if params.json_object:
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
            if params.regex is not None:
                return llguidance.LLMatcher.grammar_from_regex(params.regex)
            if params.choice is not None:
                return llguidance.grammar_from("choice", json.dumps(params.choice))
            return llguidance.grammar_from("grammar", params.grammar)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"invalid {params.kind} for structured outputs: {exc}") from exc
