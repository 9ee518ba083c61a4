"""SamplingParams: normalisation, validation messages that name the field and value, and clone()."""

from __future__ import annotations

import re

import pytest

from heteroserve.sampling_params import RequestOutputKind, SamplingParams


def test_defaults() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert params.stop_strings == [] and params.stop_token_ids == []
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert not params.greedy


def test_greedy_means_temperature_zero() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_stop_is_normalised_to_a_list() -> None:
    params = SamplingParams(stop="END")
    assert params.stop == ["END"] and params.stop_strings == ["END"]
    assert SamplingParams(stop=["a", "", "b"]).stop_strings == ["a", "b"]  # empty strings never match
    assert SamplingParams(stop="").stop_strings == []


def test_stop_token_ids_are_copied() -> None:
    ids = [5, 6]
    params = SamplingParams(stop_token_ids=ids)
    ids.append(7)
    assert params.stop_token_ids == [5, 6]


def test_top_k_minus_one_means_no_limit() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("logprobs", 1.5),
        ("prompt_logprobs", -1),
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"five": 1.0}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -1]),
        ("bad_words", [" "]),
        ("bad_words", "word"),
    ],
)
def test_invalid_value_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got {re.escape(repr(value))}$"):
        SamplingParams(**{field: value})


def test_logit_bias_keys_become_token_ids() -> None:
    """OpenAI's JSON names the tokens by strings; the sampler indexes by integers."""
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^min_tokens must be >= 0 and <= max_tokens, got 5$"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"max_tokens": None},
        {"max_tokens": 1},
        {"logprobs": 0, "prompt_logprobs": 0},
        {"n": 4, "seed": 0},
        {"logit_bias": {3: -100.0, 4: 100.0}},
        {"allowed_token_ids": [0]},
        {"bad_words": ["x"]},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_clone_applies_changes_and_leaves_the_original_alone() -> None:
    params = SamplingParams(n=3, seed=7, stop_token_ids=[5], stop="END")
    child = params.clone(n=1, seed=8)
    assert (child.n, child.seed) == (1, 8)
    assert (params.n, params.seed) == (3, 7)
    assert child.stop_strings == ["END"]
    child.stop_token_ids.append(9)
    assert params.stop_token_ids == [5]


def test_clone_can_change_stop_token_ids() -> None:
    params = SamplingParams(stop_token_ids=[5])
    extended = params.clone(stop_token_ids=params.stop_token_ids + [100])  # as the engine adds extra EOS ids
    assert extended.stop_token_ids == [5, 100]
    assert params.stop_token_ids == [5]


def test_clone_can_change_stop_strings() -> None:
    params = SamplingParams(stop="a")
    assert params.clone(stop="b").stop_strings == ["b"]
    assert params.stop_strings == ["a"]


def test_clone_validates_changes() -> None:
    with pytest.raises(ValueError, match=r"^n must be an integer >= 1, got 0$"):
        SamplingParams().clone(n=0)


def test_clone_keeps_output_kind() -> None:
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    assert params.clone().output_kind == RequestOutputKind.DELTA
    assert params.clone(output_kind=RequestOutputKind.FINAL_ONLY).output_kind == RequestOutputKind.FINAL_ONLY
