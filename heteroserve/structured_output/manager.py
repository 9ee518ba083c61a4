"""The engine's structured-output state: a grammar matcher per request, its next-token mask, and its advance.

Before a step, every request that samples under a grammar gets the bitmask of tokens that keep its output a valid
prefix of the grammar (one bit per vocabulary entry, 32 to an int32); the sampler turns off the others. After the
step, each matcher consumes the tokens its request kept. Requests without a grammar never reach this class.

With a reasoning parser the grammar applies to the answer, never to the reasoning (reasoning_markers.py):
- an output that starts inside its reasoning (DeepSeek-R1's, or a prompt ending in `<think>`) generates freely
  until its output contains the end marker (`</think>`), and the grammar applies to what follows;
- an output that may open with reasoning (Qwen3's) is masked from its first token to the grammar's tokens and the
  start marker's next token: once it has written the whole start marker it reasons freely as above, and the
  first token that leaves the marker makes the whole output the answer, constrained from its first token.
A grammar that fails while a request generates (a token it cannot take, or the engine's limits) ends that request
with an error: `advance` returns it; the output is never left unconstrained.
"""

from __future__ import annotations

import enum
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy
import numpy as np

from heteroserve.structured_output.grammar_compiler import GrammarCompiler
from heteroserve.structured_output.reasoning_markers import ReasoningMarkers

logger = logging.getLogger(__name__)


class _Phase(enum.Enum):
    OPENING = "opening"  # the output so far is a prefix of the start marker; it may still be the answer
    REASONING = "reasoning"  # free text until the end marker
    ANSWER = "answer"  # under the grammar


@dataclass
class _Constrained:
    grammar: str
    phase: _Phase
    matcher: llguidance.LLMatcher | None
    markers: ReasoningMarkers | None = None
    output: list[int] = field(default_factory=list)  # tokens so far, while OPENING; the last ones while REASONING


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._requests: dict[str, _Constrained] = {}
        self._width = llguidance.numpy.get_bitmask_shape(1, compiler.tokenizer.vocab_size)[1]
        # Masks of a step are computed on every core, outside the GIL: a JSON string's mask admits most of the
        # vocabulary, the expensive kind (bench/README.md, "Structured outputs").
        self._executor = llguidance.LLExecutor(num_threads=len(os.sched_getaffinity(0)))
        # ... from a thread of their own, so that they overlap the model's step (llguidance leaves the GIL).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, grammar: str, markers: ReasoningMarkers | None = None) -> None:
        """Starts constraining a request: at once (no markers), after its reasoning, or as module doc says."""
        if markers is None:
            state = _Constrained(grammar, _Phase.ANSWER, self.compiler.matcher(grammar))
        elif markers.start is None:
            state = _Constrained(grammar, _Phase.REASONING, None, markers)
        else:
            state = _Constrained(grammar, _Phase.OPENING, self.compiler.matcher(grammar), markers)
        self._requests[request_id] = state

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def start_bitmasks(self, request_ids: list[str]) -> Future[dict[str, np.ndarray]] | None:
        """`bitmasks` computed in the background; None when none of these requests is constrained."""
        if not any(rid in self._requests for rid in request_ids):
            return None
        return self._thread.submit(self.bitmasks, request_ids)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)

    def bitmasks(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """The next-token bitmask (int32 row) of each listed request that is masked now (not reasoning).
        A complete grammar allows only an eos."""
        states = [(rid, self._requests[rid]) for rid in request_ids if rid in self._requests]
        states = [(rid, s) for rid, s in states if s.phase is not _Phase.REASONING]
        if not states:
            return {}
        masks = np.zeros((len(states), self._width), dtype=np.int32)
        matched = [(s.matcher, row) for row, (_, s) in enumerate(states) if not s.matcher.is_error()]
        if matched:  # an opening output the grammar cannot take any more has only the marker's next token
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, matched, masks)
        for row, (_, state) in enumerate(states):
            if state.phase is _Phase.OPENING:
                token = state.markers.start[len(state.output)]
                masks[row, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        return {rid: masks[row] for row, (rid, _) in enumerate(states)}

    def advance(self, request_id: str, token_ids: list[int]) -> str | None:
        """Feeds a request's newly kept tokens to its matcher (or to the wait for the end of its reasoning).
        Returns the grammar's error when a token breaks it: the request must end with that error."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        for token in token_ids:
            if state.phase is _Phase.OPENING:
                if not self._open(state, token):
                    del self._requests[request_id]
                    return self._error(request_id, token, state.matcher)
            elif state.phase is _Phase.REASONING:
                end = state.markers.end
                state.output = (state.output + [token])[-len(end) :]
                if tuple(state.output) == end:
                    state.phase, state.matcher = _Phase.ANSWER, self.compiler.matcher(state.grammar)
            elif state.matcher.is_stopped():
                # The grammar was complete and this is the eos it allowed; what follows (ignore_eos) is free.
                del self._requests[request_id]
                return None
            elif not state.matcher.consume_token(token):
                del self._requests[request_id]
                return self._error(request_id, token, state.matcher)
        return None

    @staticmethod
    def _open(state: _Constrained, token: int) -> bool:
        """One token of an output that may still open with the start marker; False when it leaves the marker
        and the grammar cannot take the output."""
        start = state.markers.start
        if not state.matcher.is_error():
            state.matcher.consume_token(token)  # an error here only means the output is not the answer
        state.output.append(token)
        if tuple(state.output) == start:
            state.phase, state.matcher, state.output = _Phase.REASONING, None, []
        elif tuple(state.output) != start[: len(state.output)]:
            state.phase, state.output = _Phase.ANSWER, []
            return not state.matcher.is_error()
        return True

    @staticmethod
    def _error(request_id: str, token: int, matcher: llguidance.LLMatcher) -> str:
        detail = matcher.get_error().strip().splitlines()[0] if matcher.get_error() else "no detail"
        logger.warning("request %s: token %d breaks its grammar (%s); the request ends with an error",
                       request_id, token, detail)  # fmt: skip
        return f"the output's grammar failed at token {token}: {detail}"
