"""Reasoning parsers: a reasoning model's output split into its thinking (`reasoning_content`) and its answer.

Names as vLLM's --reasoning-parser. Reasoning and content are both stripped at their ends (None when empty), in
`extract` and in streams alike, so Qwen3's empty `<think>\\n\\n</think>\\n\\n` gives no reasoning, and the content
starts after the whitespace that follows `</think>`.
"""

from __future__ import annotations

import re

from heteroserve.config import REASONING_FORMATS
from heteroserve.entrypoints.openai.tool_parsers.stream_text import Trimmer, partial_marker_len

START, END = REASONING_FORMATS["qwen3"].start, REASONING_FORMATS["qwen3"].end
_START = re.compile(r"\s*" + re.escape(START))


class ReasoningParser:
    """Splits `<think>...</think>` reasoning from the answer after it.

    A `<think>` counts only at the start of the output (after whitespace); reasoning runs to the first `</think>`,
    or to the end of the output when none comes (the model ran out of tokens while thinking). Formats differ in
    whether an output without `<think>` starts inside the reasoning (`starts_in_reasoning`).
    """

    starts_in_reasoning = False

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output."""
        opening = _START.match(text)
        if opening:
            text = text[opening.end() :]
        elif not self.starts_in_reasoning:
            return None, text.strip() or None
        reasoning, _, content = text.partition(END)
        return reasoning.strip() or None, content.strip() or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_in_reasoning)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: its chat template ends the prompt with `<think>`, so the output starts inside the reasoning (a
    `<think>` it writes anyway is dropped) and is all reasoning until `</think>`, as vLLM's deepseek_r1 parser."""

    starts_in_reasoning = REASONING_FORMATS["deepseek_r1"].starts_in_reasoning


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the output reasons only inside the `<think>...</think>` it starts with; with `enable_thinking: false`
    it writes none (or an empty one), and an output without one is all content."""

    starts_in_reasoning = REASONING_FORMATS["qwen3"].starts_in_reasoning


class ReasoningStream:
    """Turns one streamed output into `{"reasoning_content": ...}` and `{"content": ...}` deltas.

    Their texts join to what `extract` gives for the whole output. Text waits only while it may be the start of
    a marker, or whitespace that may turn out to be at an end of the reasoning or the content.
    """

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
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
        if self._state == "opening":
            head = self._pending.lstrip()
            if head.startswith(START):
                self._pending, self._state = head[len(START) :], "reasoning"
            elif START.startswith(head) and not final:
                return
            else:
                self._state = "reasoning" if self._starts_in_reasoning else "content"
        if self._state == "reasoning":
            end = self._pending.find(END)
            if end < 0:
                keep = 0 if final else partial_marker_len(self._pending, END)
                self._emit("reasoning_content", self._reasoning, self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                return
            self._emit("reasoning_content", self._reasoning, self._pending[:end])
            self._pending, self._state = self._pending[end + len(END) :], "content"
        self._emit("content", self._content, self._pending)
        self._pending = ""

    def _emit(self, key: str, trimmer: Trimmer, text: str) -> None:
        text = trimmer.push(text)
        if text:
            self._deltas.append({key: text})

    def _take(self) -> list[dict]:
        deltas, self._deltas = self._deltas, []
        return deltas


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class `--reasoning-parser name` selects."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None
