"""Draft tokens for speculative decoding, looked up in a request's own tokens (no draft model).

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked for earlier in the prompt and
output; the tokens that followed their latest occurrence are the draft. Each request keeps an index from every
n-gram it has seen to where that n-gram last ended, extended by the tokens appended since the previous step, so
a proposal costs a few dictionary lookups whatever the request's length.
"""

from __future__ import annotations

from heteroserve.config import SpeculativeConfig
from heteroserve.core.request import Request


class _NgramIndex:
    def __init__(self) -> None:
        self.latest_end: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.indexed_ends = 1  # n-grams ending before this position are in latest_end


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to min(num_speculative_tokens, limit) tokens likely to follow the request's tokens; [] if none."""
        limit = min(limit, self.num_speculative_tokens)
        if limit < 1:
            return []
        tokens = request.token_ids
        index = self._indexes.setdefault(request.request_id, _NgramIndex())
        # Only n-grams ending before the last token count as earlier occurrences: the suffix itself is excluded.
        for end in range(index.indexed_ends, len(tokens)):
            for n in self.sizes:
                if end >= n:
                    index.latest_end[tuple(tokens[end - n : end])] = end
        index.indexed_ends = max(index.indexed_ends, len(tokens))
        for n in self.sizes:
            if len(tokens) > n:
                end = index.latest_end.get(tuple(tokens[-n:]))
                if end is not None:
                    return tokens[end : end + limit]
        return []

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
