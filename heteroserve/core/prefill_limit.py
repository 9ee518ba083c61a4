"""How many prompt tokens one step may prefill.

Filling the token budget with a burst's prompts makes every client of the burst wait for all of them: 16 prompts
of 128 tokens fit one step of 2048, and no client sees a token before that step ends. With a cap of 512 the burst is
prefilled in four steps; the first four clients get their first token after a quarter of the work, the next four
decode alongside the second quarter, and the median client waits about half as long. The work is nearly the same
(a prompt's rows cost what they cost in any step, plus a little per step). The cap holds only while prompts of
several requests wait: a lone prompt still fills the budget, since splitting it would only delay its own answer.
"""

from __future__ import annotations


class PrefillLimit:
    """The prompt tokens left to hand out in the current step (None: only the step's token budget limits them)."""

    def __init__(self, max_tokens_per_step: int | None) -> None:
        if max_tokens_per_step is not None and max_tokens_per_step < 1:
            raise ValueError(f"max_prefill_tokens_per_step must be >= 1, got {max_tokens_per_step}")
        self.max_tokens_per_step = max_tokens_per_step
        self.left: int | None = None

    def start_step(self, prefilling_requests: int) -> None:
        """prefilling_requests: the requests whose prompts wait, wholly or in part, at the start of the step."""
        self.left = self.max_tokens_per_step if prefilling_requests > 1 else None

    def allowance(self, wanted: int, whole: bool = False) -> int:
        """Prompt tokens a request may prefill now, up to `wanted`; `whole` (a pooling request, or no chunked
        prefill) gets all or, unless it is the step's first prefill, none."""
        if self.left is None:
            return wanted
        if whole:
            return wanted if wanted <= self.left or self.left == self.max_tokens_per_step else 0
        return min(wanted, self.left)

    def take(self, tokens: int) -> None:
        """Counts prompt tokens a scheduled request prefills in this step."""
        if self.left is not None:
            self.left = max(self.left - tokens, 0)
