"""Reasoning parsers: outputs of DeepSeek-R1 and Qwen3, and streams that equal `extract` however text is split.

For every text (not only well-formed ones) the streamed reasoning and content join to exactly `extract`'s ("" for
None): both strip each part at its ends.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heteroserve.config import REASONING_FORMATS
from heteroserve.entrypoints.openai.reasoning_parsers import reasoning_parser


def stream(name: str, pieces: list[str]) -> tuple[str, str]:
    parser_stream = reasoning_parser(name).stream()
    deltas = [delta for piece in pieces for delta in parser_stream.feed(piece)] + parser_stream.finish()
    parts = {"reasoning_content": "", "content": ""}
    for delta in deltas:
        ((key, text),) = delta.items()
        assert text
        parts[key] += text
    return parts["reasoning_content"], parts["content"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Let me think.\nOK.\n</think>\n\nThe answer is 4.", ("Let me think.\nOK.", "The answer is 4.")),
        ("<think>\nhmm</think>4", ("hmm", "4")),
        ("still thinking when max_tokens hit", ("still thinking when max_tokens hit", None)),
        ("</think>\n\nJust the answer.", (None, "Just the answer.")),
        ("a</think>b</think>c", ("a", "b</think>c")),
        ("", (None, None)),
    ],
)
def test_deepseek_r1_output_starts_inside_the_reasoning(text, expected):
    assert reasoning_parser("deepseek_r1").extract(text) == expected
    assert stream("deepseek_r1", list(text)) == tuple(part or "" for part in expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\nThe user wants 2+2. 思考.\n</think>\n\n2 + 2 = 4 😀", ("The user wants 2+2. 思考.", "2 + 2 = 4 😀")),
        ("<think>\n\n</think>\n\nNo thinking here.", (None, "No thinking here.")),
        ("No think block at all.", (None, "No think block at all.")),
        ("The tag <think> mid-text is content.</think>", (None, "The tag <think> mid-text is content.</think>")),
        ("<think>cut off", ("cut off", None)),
        ("<thi", (None, "<thi")),
    ],
)
def test_qwen3_reasons_only_inside_a_think_block_it_starts_with(text, expected):
    assert reasoning_parser("qwen3").extract(text) == expected
    assert stream("qwen3", list(text)) == tuple(part or "" for part in expected)


def test_stream_sends_reasoning_as_it_arrives_and_holds_back_only_possible_markers():
    parser_stream = reasoning_parser("qwen3").stream()
    assert parser_stream.feed("<th") == []
    assert parser_stream.feed("ink>\nFirst") == [{"reasoning_content": "First"}]
    assert parser_stream.feed(" idea.\n</th") == [{"reasoning_content": " idea."}]
    assert parser_stream.feed("ink>\n\nAnswer") == [{"content": "Answer"}]
    assert parser_stream.feed(" <think>") == [{"content": " <think>"}]  # after the reasoning, markers are text
    assert parser_stream.feed("\n") == [] and parser_stream.finish() == []  # trailing whitespace is stripped


def test_reasoning_parser_names_the_known_parsers():
    assert set(REASONING_FORMATS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("nope")


FRAGMENTS = ["<think>", "</think>", "<th", "</th", "ink>", "<", "/", ">", " ", "\n", "a", "é", "😀", "\n\n"]


@pytest.mark.parametrize("name", sorted(REASONING_FORMATS))
@settings(max_examples=200)
@given(data=st.data())
def test_streams_equal_extract_however_split(name, data):
    text = data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=20).map("".join))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))))
    bounds = [0, *cuts, len(text)]
    reasoning, content = reasoning_parser(name).extract(text)
    pieces = [text[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]
    assert stream(name, pieces) == (reasoning or "", content or "")


def test_the_server_parsers_and_the_engine_read_one_registry():
    """The engine waits for the reasoning the server's parser splits off: the parser is made of the engine's format."""
    for name, format in REASONING_FORMATS.items():
        assert reasoning_parser(name).format is format
