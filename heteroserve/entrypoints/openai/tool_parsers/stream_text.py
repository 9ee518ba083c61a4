"""Text helpers for parsers that read streamed model output: markers that may still be arriving, and trimming."""

from __future__ import annotations


def partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` without being all of it.

    That much text has to wait for the next delta: it may yet become the marker.
    """
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class Trimmer:
    """Streams a text without the whitespace at its two ends, so the pieces join to `"".join(pieces).strip()`.

    Leading whitespace is dropped; a run of whitespace at the end of what has arrived waits until text follows it
    (then it goes out) or the stream ends (then it is dropped).
    """

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        """The part of `text` (with any whitespace held from before) that can go out now."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out = self._held + body
        self._held = text[len(body) :]
        return out
