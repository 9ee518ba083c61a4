"""The grammar's token mask: llguidance's bitmask as the sampler applies it, and what sampling under it produces.

The mask is checked against numpy's own bit unpacking, and the text sampled under a regex against the `regex`
package's partial matching (an engine independent of llguidance)."""

from __future__ import annotations

import copy
import json

import jsonschema
import numpy as np
import pytest
import regex
import torch
from hypothesis import given
from hypothesis import strategies as st

from heteroserve.config import REASONING_FORMATS
from heteroserve.model.layers.sampler import SamplingRow, apply_token_bitmasks
from heteroserve.sampling_params import SamplingParams
from heteroserve.structured_output import StructuredOutputsParams
from heteroserve.structured_output.ascii_classes import ascii_regex, ascii_schema
from heteroserve.structured_output.grammar_compiler import GrammarCompiler
from heteroserve.structured_output.manager import StructuredOutputManager
from heteroserve.structured_output.reasoning_markers import ReasoningMarkers, reasoning_markers

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


def random_walk(
    compiler, vocab: int, params: StructuredOutputsParams, choices: list[int]
) -> tuple[list[tuple[np.ndarray, list[int]]], bool]:
    """Tokens drawn by `choices` from each step's allowed ones, until an eos is drawn or the choices run out:
    (allowed ids, tokens so far) before each draw, and whether the walk drew its eos."""
    manager = StructuredOutputManager(compiler)
    manager.add("walk", compiler.grammar(params))
    steps, tokens = [], []
    for choice in choices:
        allowed = allowed_ids(manager.bitmasks(["walk"])["walk"], vocab)
        steps.append((allowed, list(tokens)))
        token = int(allowed[choice % len(allowed)])
        if token == EOS:
            return steps, True
        tokens.append(token)
        assert manager.advance("walk", [token]) is None, "a token the mask allowed broke the grammar"
    return steps, False


# Both constraints are bounded (PATTERN matches at most 21 characters; every string, number and array of SCHEMA
# is bounded, ~60 characters at most), so a walk of one token a character at worst draws its eos within its
# choices: a walk that does not has found a grammar that goes on where it must end.
@given(st.lists(st.integers(min_value=0, max_value=2**32), min_size=40, max_size=40))
def test_every_token_sampled_under_a_regex_keeps_a_valid_prefix(compiler, default_tokenizer, choices):
    """Random walks through the allowed tokens: each text is a prefix of a match, an eos comes only after a full
    one, and every walk ends with one."""
    steps, ended = random_walk(compiler, len(default_tokenizer), StructuredOutputsParams(regex=PATTERN), choices)
    for allowed, tokens in steps:
        text = default_tokenizer.decode(tokens)
        assert regex.fullmatch(PATTERN, text, partial=True), tokens
        if EOS in allowed:
            assert regex.fullmatch(PATTERN, text)
    assert ended, default_tokenizer.decode(steps[-1][1])


@given(st.lists(st.integers(min_value=0, max_value=2**32), min_size=80, max_size=80))
def test_json_sampled_under_a_schema_validates(compiler, default_tokenizer, choices):
    """Every walk ends with an eos, after an object that validates (and an eos is allowed only after one)."""
    steps, ended = random_walk(compiler, len(default_tokenizer), StructuredOutputsParams(json=SCHEMA), choices)
    assert ended, default_tokenizer.decode(steps[-1][1])
    for allowed, tokens in steps:
        if EOS in allowed:
            jsonschema.validate(json.loads(default_tokenizer.decode(tokens)), SCHEMA)


def markers(tokenizer, start: bool) -> ReasoningMarkers:
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    return ReasoningMarkers(encode("<think>") if start else None, encode("</think>"))


def opens_json(tokenizer, mask: np.ndarray) -> bool:
    return all(tokenizer.decode([t]).startswith("{") for t in allowed_ids(mask, len(tokenizer)))


def test_the_grammar_starts_after_the_reasoning(compiler, default_tokenizer):
    manager = StructuredOutputManager(compiler)
    manager.add("r", compiler.grammar(StructuredOutputsParams(json=SCHEMA)), markers(default_tokenizer, False))
    manager.advance("r", default_tokenizer.encode("<think>I should answer in JSON", add_special_tokens=False))
    assert manager.bitmasks(["r"]) == {}  # still reasoning: free text
    manager.advance("r", list(markers(default_tokenizer, False).end))
    assert opens_json(default_tokenizer, manager.bitmasks(["r"])["r"])


def test_an_output_that_does_not_open_with_think_is_the_answer_from_its_first_token(compiler, default_tokenizer):
    """Qwen3's format: the first token is the grammar's or the start of `<think>`; writing the whole marker
    starts free reasoning, anything else is the answer, already under the grammar."""
    start = markers(default_tokenizer, True).start
    grammar = compiler.grammar(StructuredOutputsParams(json=SCHEMA))
    manager = StructuredOutputManager(compiler)
    manager.add("answer", grammar, markers(default_tokenizer, True))
    manager.add("think", grammar, markers(default_tokenizer, True))
    first = manager.bitmasks(["answer", "think"])
    for mask in first.values():
        allowed = allowed_ids(mask, len(default_tokenizer))
        assert start[0] in allowed
        assert {default_tokenizer.decode([t])[0] for t in allowed} == {"{", "<"}
    manager.advance("answer", default_tokenizer.encode('{"', add_special_tokens=False))
    after = {
        default_tokenizer.decode([t])
        for t in allowed_ids(manager.bitmasks(["answer"])["answer"], len(default_tokenizer))
    }
    assert "name" in after and "<" not in after  # the answer's JSON goes on, no marker any more
    manager.advance("think", list(start))
    manager.advance("think", default_tokenizer.encode("free text { } [", add_special_tokens=False))
    assert manager.bitmasks(["think"]) == {}
    manager.advance("think", list(markers(default_tokenizer, True).end))
    assert opens_json(default_tokenizer, manager.bitmasks(["think"])["think"])


@pytest.fixture(scope="module")
def thinking_tokenizer(default_tokenizer):
    """The default tokenizer with `<think>` and `</think>` as tokens of their own, as a thinking model's has."""
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    return tokenizer


@pytest.mark.parametrize(
    "parser, prompt, thinking_tokens, expected",
    [
        ("qwen3", "<|im_start|>assistant\n", True, "may open"),
        ("qwen3", "<|im_start|>assistant\n", False, "answer"),  # `<think>` in pieces: a model that does not think
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", True, "answer"),  # enable_thinking=False
        ("qwen3", "<|im_start|>assistant\n<think>\n", True, "reasoning"),  # the prompt opens the reasoning
        ("deepseek_r1", "<｜Assistant｜>", True, "reasoning"),
        ("deepseek_r1", "<｜Assistant｜>", False, "reasoning"),
    ],
)
def test_where_the_answer_begins(default_tokenizer, thinking_tokenizer, parser, prompt, thinking_tokens, expected):
    tokenizer = thinking_tokenizer if thinking_tokens else default_tokenizer
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    found = reasoning_markers(REASONING_FORMATS[parser], prompt, encode)
    end = tuple(encode("</think>"))
    assert (
        found
        == {
            "answer": None,
            "reasoning": ReasoningMarkers(None, end),
            "may open": ReasoningMarkers(tuple(encode("<think>")), end),
        }[expected]
    )
    if expected == "may open":
        assert len(found.start) == len(found.end) == 1


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error(compiler, default_tokenizer):
    manager = StructuredOutputManager(compiler)
    manager.add("r", compiler.grammar(StructuredOutputsParams(json=SCHEMA)))
    error = manager.advance("r", default_tokenizer.encode("Sure", add_special_tokens=False))
    assert error is not None and "grammar failed" in error and "r" not in manager


@pytest.mark.parametrize(
    "written, ascii",
    [
        (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
        (r"[\d\s]+\W", "[[0-9][\\t\\n\\x0B\\x0C\\r ]]+[^0-9A-Za-z_]"),
        (r"\\d\.\p{L}", r"\\d\.\p{L}"),  # an escaped backslash, an escaped dot and a Unicode class stay
    ],
)
def test_class_escapes_become_ascii_classes(written, ascii):
    assert ascii_regex(written) == ascii


def test_schema_patterns_become_ascii_but_names_and_data_do_not():
    schema = {
        "properties": {"pattern": {"type": "string", "pattern": r"^\d+$"}},
        "patternProperties": {r"^\w$": {"const": r"\d"}},
        "$defs": {"A": {"items": [{"pattern": r"\s"}]}},
    }
    assert ascii_schema(schema) == {
        "properties": {"pattern": {"type": "string", "pattern": "^[0-9]+$"}},
        "patternProperties": {"^[0-9A-Za-z_]$": {"const": r"\d"}},
        "$defs": {"A": {"items": [{"pattern": "[\\t\\n\\x0B\\x0C\\r ]"}]}},
    }


@pytest.mark.parametrize(
    "unicode, ascii",
    [
        (StructuredOutputsParams(regex=r"\d"), StructuredOutputsParams(regex="[0-9]")),
        (
            StructuredOutputsParams(json={"type": "string", "pattern": r"^\w$"}),
            StructuredOutputsParams(json={"type": "string", "pattern": "^[0-9A-Za-z_]$"}),
        ),
    ],
)
def test_regex_classes_allow_the_ascii_tokens_only(compiler, default_tokenizer, unicode, ascii):
    """The default vocabulary has Unicode digits and letters (U+1FBF8 '🯸' is a decimal digit): `\\d` and `\\w`
    allow exactly what their ASCII classes allow."""
    masks = []
    for params in (unicode, ascii):
        manager = StructuredOutputManager(compiler)
        manager.add("r", compiler.grammar(params))
        masks.append(allowed_ids(manager.bitmasks(["r"])["r"], len(default_tokenizer)))
    assert np.array_equal(masks[0], masks[1])


@pytest.mark.parametrize(
    "params, fragment",
    [
        (StructuredOutputsParams(regex="[0-9"), "regex"),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "json"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
        (StructuredOutputsParams(regex="a{1000000}"), "regex"),
        (StructuredOutputsParams(json={"$ref": "#"}), "json"),
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
