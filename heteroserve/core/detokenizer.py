"""Incremental detokenization with stop strings.

Text is produced with the tokenizers library's `DecodeStream`, which holds back bytes until they form
whole UTF-8 characters, so a Chinese character split across tokens is never emitted broken. Stop strings
are matched on the accumulated text; while a request runs, the last `len(longest stop) - 1` characters
are held back, so a stop string that spans tokens is never partly emitted.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop_strings: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop_strings = stop_strings
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.text = ""
        self.stopped_by: str | None = None
        self._num_emitted = 0
        self._prime(prompt_token_ids)

    def _prime(self, prompt_token_ids: list[int]) -> None:
        """Feeds the tail of the prompt so the first output token decodes with its proper spacing."""
        for token in prompt_token_ids[-6:]:
            self.stream.step(self.tokenizer, token)

    def add_token(self, token_id: int, check_stop: bool = True) -> bool:
        """Appends one token's text; True when a stop string ended the text (checked only if `check_stop`)."""
        piece = self.stream.step(self.tokenizer, token_id)
        if not piece or self.stopped_by is not None:
            return self.stopped_by is not None
        old_len = len(self.text)
        self.text += piece
        if not check_stop:
            return False
        # Only stop strings ending in the new piece count (not one that ended in a piece added before
        # min_tokens); the one that completes first wins, as it would if the text came one char at a time.
        found = [
            (i + len(s), i, s)
            for s in self.stop_strings
            if (i := self.text.find(s, max(0, old_len - len(s) + 1))) != -1
        ]
        if not found:
            return False
        _, index, stop = min(found)
        self.stopped_by = stop
        self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
        return True

    def new_text(self, finished: bool) -> str:
        """Text not yet reported, minus what could still turn out to be the start of a stop string."""
        end = len(self.text) if finished or self.stopped_by else max(self._num_emitted, len(self.text) - self.holdback)
        delta = self.text[self._num_emitted : end]
        self._num_emitted = end
        return delta

    @property
    def visible_text(self) -> str:
        return self.text[: self._num_emitted]
