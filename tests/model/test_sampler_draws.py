"""The sampler's top-k / top-p filter and its draw against plain references: a full sort of the vocabulary, and a
float64 running sum over every token searched for the same uniform numbers."""

from __future__ import annotations

import pytest
import torch

from heteroserve.model.layers.sampler import SUM_BLOCK, TOP_CANDIDATES, _filter_top_k_top_p, _inverse_transform

VOCAB = 49152


def reference_filter(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """One row at a time over the whole sorted vocabulary: keep the top_k, then the most likely tokens until the
    mass before a token (renormalised over the top_k) reaches top_p."""
    out = torch.full_like(logits, float("-inf"))
    for row, (k, p) in enumerate(zip(top_k, top_p, strict=True)):
        values, order = logits[row].double().sort(descending=True)
        k = k or len(values)
        probs = torch.softmax(values[:k], dim=0)
        before = probs.cumsum(0) - probs
        kept = int((before < p).sum()) if p < 1 else k
        out[row, order[:kept]] = logits[row, order[:kept]]
    return out


def peaked_logits(rows: int, peak: float, seed: int) -> torch.Tensor:
    """Logits like a language model's: 20 likely tokens (the first `peak` above the tail) over a long tail."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen)
    logits[:, :20] += torch.linspace(peak, peak / 2, 20)
    return logits[:, torch.randperm(VOCAB, generator=gen)]


@pytest.mark.parametrize(
    "peak, top_k, top_p, keeps_past_candidates",
    [
        (18.0, [0, 40, 0, 5, 1, 0], [0.9, 1.0, 0.5, 0.95, 0.99, 0.998], False),  # top-p sets among the candidates
        (18.0, [0, 0, 3000, 0], [0.9, 1.0, 0.99, 1.0], True),  # a top_k beyond the candidates; an unfiltered row
        (6.0, [0, 0], [0.999, 0.95], True),  # a flat tail: the top-p set reaches past the candidates (full sort)
    ],
)
def test_filter_keeps_what_a_full_sort_keeps(peak, top_k, top_p, keeps_past_candidates):
    logits = peaked_logits(len(top_k), peak, seed=len(top_k))
    ours = _filter_top_k_top_p(logits.clone(), top_k, top_p)
    expected = reference_filter(logits, top_k, top_p)
    kept = torch.isfinite(ours)
    assert torch.equal(kept, torch.isfinite(expected))
    assert torch.equal(ours[kept], logits[kept])
    counts = kept.sum(dim=1).tolist()
    print(f"tokens kept per row: {counts} (candidates looked at first: {TOP_CANDIDATES})")
    assert all(count >= 1 for count in counts)
    assert (max(counts) > TOP_CANDIDATES) == keeps_past_candidates


def test_draws_are_the_full_running_sums_choice():
    """For the same uniform numbers, the token whose float64 running sum over the whole row first exceeds
    uniform x total, on rows with zero-probability tokens, a vocabulary that is not a whole number of blocks, and
    uniform numbers at the ends of [0, 1)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 3 * SUM_BLOCK + 123
    probs = torch.softmax(torch.randn(64, vocab, generator=gen) * 2, dim=-1)
    probs[probs < 1e-5] = 0.0  # tokens that must never be drawn
    probs[5, :] = 0.0
    probs[5, 2 * SUM_BLOCK + 7] = 0.25  # one row with a single possible token
    uniform = torch.rand(64, generator=gen, dtype=torch.float64)
    uniform[0], uniform[1] = 0.0, 1.0 - 2**-53
    drawn = _inverse_transform(probs, uniform)
    running = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(running, uniform[:, None] * running[:, -1:], right=True)[:, 0]
    assert torch.equal(drawn, expected.clamp(max=vocab - 1))
    assert bool((probs[torch.arange(64), drawn] > 0).all())
    assert int(drawn[5]) == 2 * SUM_BLOCK + 7


def test_draws_follow_the_distribution():
    """Frequencies over many draws from one row match its probabilities (within 4 standard errors)."""
    gen = torch.Generator().manual_seed(1)
    probs = torch.zeros(SUM_BLOCK + 10)
    probs[[3, 500, SUM_BLOCK - 1, SUM_BLOCK, SUM_BLOCK + 9]] = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    draws = 20000
    drawn = _inverse_transform(probs.expand(draws, -1), torch.rand(draws, generator=gen, dtype=torch.float64))
    counts = torch.bincount(drawn, minlength=len(probs)).double() / draws
    error = 4 * (probs.double() * (1 - probs.double()) / draws).sqrt()
    assert bool(((counts - probs.double()).abs() <= error).all()), counts[probs > 0]
    assert int(counts[probs == 0].sum()) == 0
