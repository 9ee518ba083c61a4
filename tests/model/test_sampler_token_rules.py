"""logit_bias, allowed_token_ids and bad_words in the sampler, row by row against a plain-Python reference, in a
batch that mixes rows with and without them."""

from __future__ import annotations

import math

import torch

from heteroserve.model.layers.sampler import SamplingRow, apply_token_rules
from heteroserve.sampling_params import SamplingParams

VOCAB = 40
PROMPT = [1, 2, 3]


def _row(output: list[int], bad_words: list[list[int]] | None = None, **params) -> SamplingRow:
    sampling = SamplingParams(**params)
    if bad_words is not None:
        sampling = sampling.clone(bad_words=["w"], bad_words_token_ids=bad_words)
    return SamplingRow(sampling, PROMPT + output, len(PROMPT), [], None)


def _expected(logits: list[float], row: SamplingRow) -> list[float]:
    """One row's logits after the rules, token by token."""
    p = row.params
    out = list(logits)
    for token, bias in (p.logit_bias or {}).items():
        out[token] += bias
    if p.allowed_token_ids is not None:
        out = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(out)]
    output = row.token_ids[row.num_prompt_tokens :]
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or output[-len(prefix) :] == prefix:
            out[word[-1]] = -math.inf
    return out


def test_rules_match_the_reference_in_a_mixed_batch() -> None:
    rows = [
        _row([5, 6]),
        _row([7], logit_bias={3: 2.5, 9: -100.0}),
        _row([8], allowed_token_ids=[0, 4, 39]),
        _row([10, 11], bad_words=[[11, 12], [13], [20, 21]]),  # 12 follows 11; 13 always; 21 not after 11
        _row([2, 3], bad_words=[[1, 2, 3, 4]]),  # the prefix spans the prompt: not banned, the output is [2, 3]
        _row([], logit_bias={0: 1.0}, allowed_token_ids=[0, 1], bad_words=[[5, 6], [1]]),
    ]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    adjusted = apply_token_rules(logits, rows)
    assert torch.equal(logits, before)  # a copy: the raw logits stay for logprobs
    for i, row in enumerate(rows):
        expected = torch.tensor(_expected(before[i].tolist(), row))
        torch.testing.assert_close(adjusted[i], expected, msg=f"row {i}")


def test_rows_without_rules_are_not_copied() -> None:
    logits = torch.zeros(2, VOCAB)
    assert apply_token_rules(logits, [_row([]), _row([4])]) is logits
