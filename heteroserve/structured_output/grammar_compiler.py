"""Structured-output constraints compiled to llguidance grammars, validated once and cached.

llguidance is the grammar engine (compared with xgrammar in bench/README.md, "Structured outputs": it compiles a
per-request schema faster, both mask far below a decode step's time, and it installs without dependencies where
xgrammar pulls triton). It reads JSON schemas, regexes, Lark and GBNF grammars natively.

A constraint is checked before its request is queued: llguidance validates the grammar, then a matcher takes its
first token, which is where a grammar past the engine's limits (`a{1000000}`: "too many expressions constructed")
or one that admits nothing (a `$ref` loop) fails. Regexes and schema patterns read `\\d \\w \\s` as ASCII
(ascii_classes.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from heteroserve.structured_output.ascii_classes import ascii_regex, ascii_schema
from heteroserve.structured_output.params import StructuredOutputsParams

# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): a small model that may pad with
# newlines forever under flexible whitespace still ends its object.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check_strict_schema(schema: dict) -> None:
    """ValueError naming the keywords of a JSON schema that the grammar engine cannot enforce (no tokenizer
    needed: the schema's grammar is only validated)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(ascii_schema(schema)), defaults={**_JSON_OPTIONS, "lenient": False}
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid json for structured outputs: {exc}") from exc
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"invalid json for structured outputs: {error.strip()}")


class GrammarCompiler:
    """Turns `StructuredOutputsParams` into llguidance matchers over one tokenizer's vocabulary."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 512) -> None:
        # The model's vocabulary may be wider than the tokenizer's: masks cover every logit, extra ones disallowed.
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=max(vocab_size, len(hf_tokenizer)), eos_token=eos_token_ids
        )
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
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
        error = self._first_token_error(grammar)
        if error:
            raise ValueError(
                f"invalid {params.kind} for structured outputs: the grammar engine cannot enforce it ({error})"
            )
        self._cache[key] = grammar
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)

    def allowed_token_ids(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """The token ids the matcher allows next, in increasing order."""
        mask = np.zeros(llguidance.numpy.get_bitmask_shape(1, self.tokenizer.vocab_size), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        return np.flatnonzero(np.unpackbits(mask.astype("<i4", copy=False).view(np.uint8), bitorder="little"))

    def _first_token_error(self, grammar: str) -> str | None:
        """The engine's error when a matcher starts and takes one allowed token (None: it does)."""
        matcher = self.matcher(grammar)
        allowed = self.allowed_token_ids(matcher)
        if not matcher.is_error():
            tokens = [int(t) for t in allowed if int(t) not in self.eos_token_ids]
            if tokens:
                matcher.consume_token(tokens[0])
        return matcher.get_error().strip().splitlines()[0] if matcher.is_error() else None

    @staticmethod
    def _build(params: StructuredOutputsParams) -> str:
        options = {**_JSON_OPTIONS, "lenient": not params.strict}
        try:
            if params.json is not None:
                schema = json.loads(params.json) if isinstance(params.json, str) else params.json
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(ascii_schema(schema)), defaults=options)
            if params.json_object:
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
            if params.regex is not None:
                return llguidance.LLMatcher.grammar_from_regex(ascii_regex(params.regex))
            if params.choice is not None:
                return llguidance.grammar_from("choice", json.dumps(params.choice))
            return llguidance.grammar_from("grammar", params.grammar)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"invalid {params.kind} for structured outputs: {exc}") from exc
