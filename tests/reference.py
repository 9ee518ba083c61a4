"""The transformers reference and the greedy-comparison rule of DEVELOPERS.md.

Two greedy runs that batch differently are compared token by token up to the first divergence; a
divergence is accepted only where the reference's top-2 logits differ by less than 1e-3 (float32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NEAR_TIE = 1e-3


@dataclass
class ReferenceRun:
    tokens: list[int]
    logits: list[torch.Tensor]  # float32 logits that chose each token


class HFReference:
    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._cache: dict[tuple, ReferenceRun] = {}

    def _inputs(self, token_ids: list[int]) -> dict:
        """The model's keyword inputs for one prompt (a vision-language reference adds its images)."""
        ids = torch.tensor([token_ids])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> ReferenceRun:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            out = self.model.generate(
                **self._inputs(prompt_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt_ids) :].tolist()
            self._cache[key] = ReferenceRun(tokens, [step[0].float() for step in out.logits])
        return self._cache[key]

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits at every position of `token_ids` (teacher forcing)."""
        return self.model(torch.tensor([token_ids])).logits[0].float()


@dataclass
class GreedyComparison:
    sequences: int = 0
    near_tie_divergences: list[str] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # the reference's top-2 logit gap at every compared token

    def check(self, label: str, ours: list[int], reference: ReferenceRun, near_tie: float = NEAR_TIE) -> None:
        """Asserts `ours` equals the reference up to a divergence at a near-tie (recorded, not failed). A run that
        rounds differently on purpose (a 16-bit KV cache) passes its own, wider `near_tie`."""
        self.sequences += 1
        for i, (mine, theirs) in enumerate(zip(ours, reference.tokens, strict=False)):
            top2 = reference.logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            self.margins.append(gap)
            if mine == theirs:
                continue
            assert gap < near_tie, (
                f"{label}: token {i} is {mine}, reference {theirs}, and the reference's top-2 logit gap "
                f"{gap:.2e} is not a near-tie; ours={ours} reference={reference.tokens}"
            )
            self.near_tie_divergences.append(f"{label} at token {i} (gap {gap:.1e})")
            return
        assert len(ours) == len(reference.tokens), f"{label}: {len(ours)} tokens, reference {len(reference.tokens)}"

    def summary(self) -> str:
        n = len(self.near_tie_divergences)
        lines = [f"greedy comparisons: {self.sequences} sequences, {n} ended at a near-tie divergence"]
        if self.margins:
            margins = torch.tensor(self.margins)
            lines.append(
                f"  reference top-2 logit margins over {len(margins)} tokens: median {margins.median():.3g}, "
                f"10th percentile {margins.quantile(0.1):.3g}, smallest {margins.min():.2e}"
            )
        lines += [f"  near-tie: {d}" for d in self.near_tie_divergences]
        return "\n".join(lines)
