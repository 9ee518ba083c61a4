"""Where a reasoning model's answer begins, as token ids: what the structured-output manager waits for before the
grammar applies (manager.py says how each case is masked)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from heteroserve.config import ReasoningFormat


@dataclass(frozen=True)
class ReasoningMarkers:
    """A reasoning format's markers as token ids. `start` None: the output starts inside the reasoning."""

    start: tuple[int, ...] | None
    end: tuple[int, ...]


def reasoning_markers(
    reasoning: ReasoningFormat, prompt: str, encode: Callable[[str], list[int]]
) -> ReasoningMarkers | None:
    """The markers a request's grammar waits on; None when its answer starts at the first output token.

    - The prompt closes the reasoning (Qwen3's template with enable_thinking=False ends in `<think>\\n\\n</think>`):
      the output is the answer.
    - The format starts the output inside the reasoning (DeepSeek-R1), or the prompt ends with the start marker:
      the answer follows the end marker.
    - Otherwise the output may open with the start marker, if the tokenizer has it as one token: every model that
      thinks in this format does, and a tokenizer that spells `<think>` in pieces belongs to a model that does not
      think, whose output is the answer (offering it the marker's first piece, `<`, would only lure it into a
      reasoning block it never closes).
    """
    tail = prompt.rstrip()
    if tail.endswith(reasoning.end):
        return None
    end = tuple(encode(reasoning.end))
    if reasoning.starts_in_reasoning or tail.endswith(reasoning.start):
        return ReasoningMarkers(None, end)
    start = tuple(encode(reasoning.start))
    return ReasoningMarkers(start, end) if len(start) == 1 else None
