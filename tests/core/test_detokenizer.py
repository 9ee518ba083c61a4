"""IncrementalDetokenizer with the default model's real tokenizer: whole characters, stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from heteroserve.core.detokenizer import IncrementalDetokenizer

PROMPT = "Here is some text:"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class Streamed:
    deltas: list[str]  # what new_text() returned after each token; the last one with finished=True
    stopped: bool
    detokenizer: IncrementalDetokenizer

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def text_before_stop(self) -> str:
        """What was streamed while the request still ran (before the final delta)."""
        return "".join(self.deltas[:-1])


def stream(
    tokenizer,
    token_ids: Sequence[int],
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
    min_tokens: int = 0,
) -> Streamed:
    """Feeds tokens one at a time as the engine does, stopping at the first stop string."""
    detokenizer = IncrementalDetokenizer(
        tokenizer._tokenizer,
        encode(tokenizer, PROMPT),
        list(stop),
        skip_special_tokens=skip_special_tokens,
        include_stop_str_in_output=include_stop_str_in_output,
    )
    deltas = []
    for num_output, token_id in enumerate(token_ids, start=1):
        stopped = detokenizer.add_token(token_id, check_stop=num_output >= min_tokens)
        deltas.append(detokenizer.new_text(finished=stopped))
        if stopped:
            return Streamed(deltas, True, detokenizer)
    deltas.append(detokenizer.new_text(finished=True))
    return Streamed(deltas, False, detokenizer)


def split_across_tokens(tokenizer, token_ids: Sequence[int], text: str) -> bool:
    """Whether no single token decodes to a string containing `text`."""
    return all(text not in tokenizer.decode([t]) for t in token_ids)


@pytest.mark.parametrize(
    "text",
    [
        "你好，世界！今天天气很好。",
        " 🎉🚀 party time 👍🏽",
        "日本語のテキストです",
        " mixed 中文 and emoji 🤖 at the end 🧠",
        " Ünïcödé ñ café",
    ],
)
def test_multibyte_characters_come_out_whole(tokenizer, text: str) -> None:
    ids = encode(tokenizer, text)
    assert any(REPLACEMENT in tokenizer.decode([t]) for t in ids), "the text should split characters across tokens"

    streamed = stream(tokenizer, ids)

    assert not any(REPLACEMENT in delta for delta in streamed.deltas)
    assert streamed.text == tokenizer.decode(ids) == text
    assert streamed.detokenizer.text == text
    assert not streamed.stopped


def test_first_output_token_keeps_its_leading_space(tokenizer) -> None:
    ids = encode(tokenizer, " Hello world")
    streamed = stream(tokenizer, ids)
    assert streamed.deltas[0] == " Hello"
    assert streamed.text == " Hello world"


def test_prompt_primes_the_spacing_of_a_sentencepiece_style_tokenizer() -> None:
    # Metaspace decoding drops the leading space of the first token of a text: a continuation must keep it.
    vocab = {"\u2581Say": 0, "\u2581Hello": 1, "\u2581world": 2, "[UNK]": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    assert tokenizer.decode([1, 2]) == "Hello world"

    detokenizer = IncrementalDetokenizer(tokenizer, [0], [])
    for token_id in (1, 2):
        detokenizer.add_token(token_id)

    assert detokenizer.new_text(finished=True) == " Hello world"
    assert tokenizer.decode([0, 1, 2]) == "Say" + detokenizer.text


def test_without_stop_strings_nothing_is_held_back(tokenizer) -> None:
    ids = encode(tokenizer, " one two three")
    streamed = stream(tokenizer, ids)
    assert streamed.deltas == [" one", " two", " three", ""]


def test_special_tokens_are_skipped_unless_asked_for(tokenizer) -> None:
    ids = encode(tokenizer, " hi") + [tokenizer.eos_token_id]
    assert stream(tokenizer, ids).text == " hi"
    assert stream(tokenizer, ids, skip_special_tokens=False).text == " hi" + tokenizer.eos_token


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    ("text", "stop"),
    [
        (" The answer is STOPHERE and more text", "STOPHERE"),
        (" The answer is STOPHERE and more text", "answer is ST"),
        ("你好，世界！再见，朋友。", "世界"),
        (" party 🎉🚀 after", "🎉🚀"),
        (" a\n\nb\n\nc", "\n\nc"),
    ],
)
def test_stop_string_spanning_tokens_is_never_streamed(tokenizer, text: str, stop: str, include: bool) -> None:
    ids = encode(tokenizer, text)
    assert split_across_tokens(tokenizer, ids, stop)
    index = text.index(stop)

    streamed = stream(tokenizer, ids, [stop], include_stop_str_in_output=include)

    assert streamed.stopped
    assert streamed.detokenizer.stopped_by == stop
    assert streamed.text == (text[: index + len(stop)] if include else text[:index])
    # While the request ran, nothing of the stop string was streamed, not even its first characters.
    assert text[:index].startswith(streamed.text_before_stop)
    assert not any(REPLACEMENT in delta for delta in streamed.deltas)


@pytest.mark.parametrize("include", [False, True])
def test_text_after_a_stop_is_dropped(tokenizer, include: bool) -> None:
    ids = encode(tokenizer, " hello world again")
    detokenizer = IncrementalDetokenizer(tokenizer._tokenizer, [], ["ell"], include_stop_str_in_output=include)

    assert detokenizer.add_token(ids[0])  # " hello": the stop ends inside the token
    expected = " hell" if include else " h"
    assert detokenizer.new_text(finished=True) == expected
    for token_id in ids[1:]:  # tokens sampled after the stop change nothing
        assert detokenizer.add_token(token_id)
        assert detokenizer.new_text(finished=True) == ""
    assert detokenizer.text == detokenizer.visible_text == expected


@pytest.mark.parametrize(
    ("stops", "stopped_by", "expected", "expected_with_stop"),
    [
        (["lo", "el"], "el", " h", " hel"),
        (["el", "lo"], "el", " h", " hel"),
        (["hello", "ell"], "ell", " h", " hell"),  # "ell" completes first, though "hello" starts first
    ],
)
def test_the_stop_string_that_completes_first_wins(
    tokenizer, stops: list[str], stopped_by: str, expected: str, expected_with_stop: str
) -> None:
    [token_id] = encode(tokenizer, " hello")  # both stop strings arrive in the same token
    for include, text in [(False, expected), (True, expected_with_stop)]:
        detokenizer = IncrementalDetokenizer(tokenizer._tokenizer, [], stops, include_stop_str_in_output=include)
        assert detokenizer.add_token(token_id)
        assert detokenizer.stopped_by == stopped_by
        assert detokenizer.new_text(finished=True) == text


def test_a_partial_match_is_released_once_it_cannot_be_a_stop(tokenizer) -> None:
    text = " The answer is STOP and STOPHERE"
    ids = encode(tokenizer, text)
    streamed = stream(tokenizer, ids, ["STOPHERE"])
    assert streamed.text == " The answer is STOP and "
    assert streamed.text_before_stop.startswith(" The answer is STOP")  # held back, then let go


def test_held_back_text_is_flushed_when_the_request_ends(tokenizer) -> None:
    text = " no stop here, only STOPHER"
    ids = encode(tokenizer, text)
    streamed = stream(tokenizer, ids, ["STOPHERE"])
    assert not streamed.stopped
    assert len(streamed.deltas[-1]) > 0  # the tail held back in case it grew into the stop string
    assert streamed.text == text
    longest = len("STOPHERE")
    assert len(streamed.text_before_stop) >= len(text) - (longest - 1)


def test_stop_strings_are_ignored_before_min_tokens(tokenizer) -> None:
    text = " hello world hello again"
    ids = encode(tokenizer, text)
    assert len(ids) == 4

    streamed = stream(tokenizer, ids, ["hello"], min_tokens=2)

    assert streamed.stopped
    assert streamed.text == text[: text.index("hello", 2)]


def test_a_stop_string_completed_before_min_tokens_is_not_caught_later(tokenizer) -> None:
    ids = encode(tokenizer, " hello world")
    assert len(ids) == 2
    streamed = stream(tokenizer, ids, ["hello", "lo"], min_tokens=2)
    assert not streamed.stopped
    assert streamed.text == " hello world"


def test_visible_text_tracks_what_was_streamed(tokenizer) -> None:
    ids = encode(tokenizer, " abc STOPHERE")
    detokenizer = IncrementalDetokenizer(tokenizer._tokenizer, [], ["STOPHERE"])
    streamed = ""
    for token_id in ids:
        stopped = detokenizer.add_token(token_id)
        streamed += detokenizer.new_text(finished=stopped)
        assert detokenizer.visible_text == streamed
        if stopped:
            break
    assert streamed == " abc "


FRAGMENTS = [" hello", " world", "你好", "世界", "🎉", "🚀", " STOP", "HERE", ".", "\n", " é", "ñ", "42", " the"]


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=12),
    stop_span=st.tuples(st.integers(0, 200), st.integers(1, 6)),
    absent_stop=st.booleans(),
    include=st.booleans(),
)
def test_streamed_text_matches_decode(
    tokenizer, parts: list[str], stop_span: tuple[int, int], absent_stop: bool, include: bool
) -> None:
    text = "".join(parts)
    ids = encode(tokenizer, text)
    decoded = tokenizer.decode(ids)
    start, length = stop_span
    start %= len(decoded)
    stop = "<never>" if absent_stop else decoded[start : start + length]

    streamed = stream(tokenizer, ids, [stop], include_stop_str_in_output=include)

    index = decoded.find(stop)
    assert streamed.stopped == (index != -1)
    if index == -1:
        assert streamed.text == decoded
    else:
        assert streamed.text == (decoded[: index + len(stop)] if include else decoded[:index])
        assert decoded[:index].startswith(streamed.text_before_stop)
    assert not any(REPLACEMENT in delta for delta in streamed.deltas)
