"""Reasoning parsers: a reasoning model's output split into its thinking (`reasoning_content`) and its answer.

Names as vLLM's --reasoning-parser. Reasoning and content are both stripped at their ends (None when empty), in
`extract` and in streams alike, so Qwen3's empty `<think>\\n\\n</think>\\n\\n` gives no reasoning, and the content
starts after the whitespace that follows `</think>`.
"""

from __future__ import annotations

import re

from heteroserve.config import REASONING_FORMATS, ReasoningFormat
from heteroserve.entrypoints.openai.tool_parsers.stream_text import Trimmer, partial_marker_len


class ReasoningParser:
    """Splits a format's `start ... end` reasoning (`<think>...</think>`) from the answer after it.

    A start marker counts only at the start of the output (after whitespace); reasoning runs to the first end
    marker, or to the end of the output when none comes (the model ran out of tokens while thinking). Formats
    differ in whether an output without the start marker starts inside the reasoning (`starts_in_reasoning`:
    DeepSeek-R1, whose chat template ends the prompt with `<think>`; Qwen3's output without one is all content).
    """

    def __init__(self, format: ReasoningFormat) -> None:
        self.format = format
        self._start = re.compile(r"\s*" + re.escape(format.start))

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output."""
        opening = self._start.match(text)
        if opening:
            text = text[opening.end() :]
        elif not self.format.starts_in_reasoning:
            return None, text.strip() or None
        reasoning, _, content = text.partition(self.format.end)
        return reasoning.strip() or None, content.strip() or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.format)


class ReasoningStream:
    """Turns one streamed output into `{"reasoning_content": ...}` and `{"content": ...}` deltas.

    Their texts join to what `extract` gives for the whole output. Text waits only while it may be the start of
    a marker, or whitespace that may turn out to be at an end of the reasoning or the content.
    """

    def __init__(self, format: ReasoningFormat) -> None:
        self._format = format
        self._pending = ""  # text received but not sent
        self._state = "opening"  # opening (a <think> may still come), reasoning, or content
        self._reasoning, self._content = Trimmer(), Trimmer()
        self._deltas: list[dict] = []

    def feed(self, delta_text: str) -> list[dict]:
        """The deltas to send for the next piece of the output."""
        self._pending += delta_text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        """The deltas left when the output ends: text held back in case it began a marker."""
        self._advance(final=True)
        return self._take()

    def _advance(self, final: bool) -> None:
        start, end_marker = self._format.start, self._format.end
        if self._state == "opening":
            head = self._pending.lstrip()
            if head.startswith(start):
                self._pending, self._state = head[len(start) :], "reasoning"
            elif start.startswith(head) and not final:
                return
            else:
                self._state = "reasoning" if self._format.starts_in_reasoning else "content"
        if self._state == "reasoning":
            end = self._pending.find(end_marker)
            if end < 0:
                keep = 0 if final else partial_marker_len(self._pending, end_marker)
                self._emit("reasoning_content", self._reasoning, self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                return
            self._emit("reasoning_content", self._reasoning, self._pending[:end])
            self._pending, self._state = self._pending[end + len(end_marker) :], "content"
        self._emit("content", self._content, self._pending)
        self._pending = ""

    def _emit(self, key: str, trimmer: Trimmer, text: str) -> None:
        text = trimmer.push(text)
        if text:
            self._deltas.append({key: text})

    def _take(self) -> list[dict]:
        deltas, self._deltas = self._deltas, []
        return deltas


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser `--reasoning-parser name` selects: the format config.REASONING_FORMATS names, which the engine
    reads too (structured outputs start after the reasoning)."""
    try:
        return ReasoningParser(REASONING_FORMATS[name])
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_FORMATS))}") from None
