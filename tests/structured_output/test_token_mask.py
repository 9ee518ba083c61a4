"""The grammar's token mask: llguidance's bitmask as the sampler applies it, and what sampling under it produces.

The mask is checked against numpy's own bit unpacking, and the text sampled under a regex against the `regex`
package's partial matching (an engine independent of llguidance)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import regex
import torch
from hypothesis import given
from hypothesis import strategies as st

from heteroserve.model.layers.sampler import SamplingRow, apply_token_bitmasks
from heteroserve.sampling_params import SamplingParams
from heteroserve.structured_output import StructuredOutputsParams
from heteroserve.structured_output.grammar_compiler import GrammarCompiler
from heteroserve.structured_output.manager import StructuredOutputManager

EOS = 2  # <|im_end|>, the default model's eos
PATTERN = (
    r"(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])(\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])){3}|[a-z]{2,8}@[a-z]{2,8}\.(com|org)"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "level": {"enum": ["low", "high"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    },
    "required": ["name", "level", "scores"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(default_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(default_tokenizer, len(default_tokenizer), [EOS])


def allowed_ids(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """numpy's unpacking of the int32 words, little-endian bit order: the reference for the sampler's."""
    bits = np.unpackbits(bitmask.astype("<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab])


def row(bitmask: np.ndarray | None) -> SamplingRow:
    mask = None if bitmask is None else torch.from_numpy(bitmask.copy())
    return SamplingRow(SamplingParams(temperature=0), [1], 1, [], None, mask)


def test_masked_logits_equal_the_unmasked_ones_on_allowed_tokens(compiler, default_tokenizer):
    vocab = len(default_tokenizer)
    manager = StructuredOutputManager(compiler)
    manager.add("json", compiler.grammar(StructuredOutputsParams(json=SCHEMA)))
    manager.add("regex", compiler.grammar(StructuredOutputsParams(regex=PATTERN)))
    manager.advance("regex", default_tokenizer.encode("19", add_special_tokens=False))
    masks = manager.bitmasks(["json", "regex"])
    logits = torch.randn(4, vocab + 64)  # a model vocabulary wider than the tokenizer's
    out = apply_token_bitmasks(logits.clone(), [row(masks["json"]), row(None), row(masks["regex"]), row(None)])
    for i, name in ((0, "json"), (2, "regex")):
        allowed = allowed_ids(masks[name], vocab)
        assert 0 < len(allowed) < vocab
        assert torch.equal(out[i, allowed], logits[i, allowed])
        disallowed = np.setdiff1d(np.arange(vocab + 64), allowed)
        assert torch.isneginf(out[i, disallowed]).all()
    assert torch.equal(out[[1, 3]], logits[[1, 3]])
    # JSON opens with "{" (and the first key's quote); the regex after "19" continues with digits or a dot.
    assert all(default_tokenizer.decode([t]).startswith("{") for t in allowed_ids(masks["json"], vocab))
    regex_next = {default_tokenizer.decode([t]) for t in allowed_ids(masks["regex"], vocab)}
    assert "." in regex_next and "5" in regex_next and "a" not in regex_next


def random_walk(compiler, vocab: int, params: StructuredOutputsParams, choices: list[int]):
    """Tokens drawn by `choices` from each step's allowed ones: yields (allowed ids, tokens so far) before each draw
    and stops at an eos or when the choices run out."""
    manager = StructuredOutputManager(compiler)
    manager.add("walk", compiler.grammar(params))
    tokens: list[int] = []
    for choice in choices:
        allowed = allowed_ids(manager.bitmasks(["walk"])["walk"], vocab)
        yield allowed, tokens
        token = int(allowed[choice % len(allowed)])
        if token == EOS:
            return
        tokens.append(token)
        manager.advance("walk", [token])
        assert "walk" in manager, "a token the mask allowed broke the grammar"


@given(st.lists(st.integers(min_value=0, max_value=2**32), min_size=40, max_size=40))
def test_every_token_sampled_under_a_regex_keeps_a_valid_prefix(compiler, default_tokenizer, choices):
    """Random walks through the allowed tokens: each text is a prefix of a match, and an eos comes only after a
    full one."""
    params = StructuredOutputsParams(regex=PATTERN)
    for allowed, tokens in random_walk(compiler, len(default_tokenizer), params, choices):
        text = default_tokenizer.decode(tokens)
        assert regex.fullmatch(PATTERN, text, partial=True), tokens
        if EOS in allowed:
            assert regex.fullmatch(PATTERN, text)


@given(st.lists(st.integers(min_value=0, max_value=2**32), min_size=80, max_size=80))
def test_json_sampled_under_a_schema_validates(compiler, default_tokenizer, choices):
    for allowed, tokens in random_walk(compiler, len(default_tokenizer), StructuredOutputsParams(json=SCHEMA), choices):
        if EOS in allowed:  # the object is complete
            jsonschema.validate(json.loads(default_tokenizer.decode(tokens)), SCHEMA)


def test_the_grammar_starts_after_the_reasoning(compiler, default_tokenizer):
    manager = StructuredOutputManager(compiler)
    marker = default_tokenizer.encode("</think>", add_special_tokens=False)
    manager.add("r", compiler.grammar(StructuredOutputsParams(json=SCHEMA)), reasoning_end=marker)
    manager.advance("r", default_tokenizer.encode("<think>I should answer in JSON", add_special_tokens=False))
    assert manager.bitmasks(["r"]) == {}  # still reasoning: free text
    manager.advance("r", marker)
    first = allowed_ids(manager.bitmasks(["r"])["r"], len(default_tokenizer))
    assert first.size and all(default_tokenizer.decode([t]).startswith("{") for t in first)


@pytest.mark.parametrize(
    "params, fragment",
    [
        (StructuredOutputsParams(regex="[0-9"), "regex"),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "json"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
    ],
)
def test_bad_constraints_are_value_errors_naming_them(compiler, params, fragment):
    with pytest.raises(ValueError, match=f"invalid {fragment}"):
        compiler.grammar(params)


@pytest.mark.parametrize(
    "kwargs", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"json": "{not json"}, {"json": "[1]"}]
)
def test_params_take_exactly_one_valid_constraint(kwargs):
    with pytest.raises(ValueError, match="structured outputs"):
        StructuredOutputsParams(**kwargs)
