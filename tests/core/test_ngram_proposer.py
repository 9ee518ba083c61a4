"""The n-gram proposer: drafts are what followed the latest earlier occurrence of the longest matching suffix."""

from __future__ import annotations

import pytest

from heteroserve.config import SpeculativeConfig
from heteroserve.core.ngram_proposer import NgramProposer
from heteroserve.core.request import Request
from heteroserve.sampling_params import SamplingParams


def request_of(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, tokens, SamplingParams(temperature=0))


def proposer(k: int = 3, longest: int = 3, shortest: int = 1) -> NgramProposer:
    return NgramProposer(
        SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=longest, prompt_lookup_min=shortest)
    )


def test_the_tokens_after_the_latest_occurrence_of_the_suffix() -> None:
    #                 0  1  2  3  4  5  6  7  8  9 10
    request = request_of([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2])
    # the suffix [1, 2] last occurred at 4-5, followed by 3, 8, 7 (the earlier one at 0-1 is older)
    assert proposer().propose(request, limit=10) == [3, 8, 7]


def test_a_longer_match_wins_over_a_later_shorter_one() -> None:
    request = request_of([5, 6, 7, 1, 4, 6, 7, 2, 3, 5, 6, 7])
    # n=3: [5, 6, 7] occurred at 0-2 (then 1, 4, 6); n=2 alone would pick [6, 7] at 5-6 (then 2, 3, 5)
    assert proposer(longest=3).propose(request, limit=10) == [1, 4, 6]
    assert proposer(longest=2).propose(request, limit=10) == [2, 3, 5]


def test_the_suffix_itself_is_not_a_match() -> None:
    assert proposer().propose(request_of([4, 5, 6]), limit=10) == []


def test_below_the_shortest_n_nothing_is_proposed() -> None:
    request = request_of([1, 2, 3, 4, 2])  # only a 1-gram matches
    assert proposer(shortest=1).propose(request, limit=10) == [3, 4, 2]
    assert proposer(shortest=2).propose(request, limit=10) == []


@pytest.mark.parametrize("limit,expected", [(0, []), (1, [3]), (2, [3, 8]), (9, [3, 8, 7])])
def test_drafts_are_cut_to_the_limit_and_to_num_speculative_tokens(limit: int, expected: list[int]) -> None:
    request = request_of([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2])
    assert proposer(k=3).propose(request, limit) == expected


def test_drafts_may_be_shorter_than_asked_near_the_end() -> None:
    request = request_of([1, 2, 1])  # [1] occurred at 0, followed by 2, 1 only
    assert proposer(k=5).propose(request, limit=5) == [2, 1]


def test_the_index_follows_appended_tokens_and_is_forgotten() -> None:
    ngram = proposer()
    request = request_of([1, 2, 3, 4])
    assert ngram.propose(request, limit=3) == []
    for token in [1, 2]:
        request.append_output_token(token)
    assert ngram.propose(request, limit=3) == [3, 4, 1]
    request.append_output_token(5)  # [1, 2, 5] is new; [2, 5] and [5] too
    assert ngram.propose(request, limit=3) == []
    ngram.forget("r")
    assert ngram._indexes == {}


@pytest.mark.parametrize(
    "values,message",
    [
        ({"method": "eagle"}, "must be one of ngram, draft_model"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
        ({"draft_model": "x"}, "unknown speculative_config keys: draft_model"),
    ],
)
def test_bad_configs_name_the_problem(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(values)
