"""The engine's structured-output state: a grammar matcher per request, its next-token mask, and its advance.

Before a step, every request that samples under a grammar gets the bitmask of tokens that keep its output a valid
prefix of the grammar (one bit per vocabulary entry, 32 to an int32); the sampler turns off the others. After the
step, each matcher consumes the tokens its request kept. Requests without a grammar never reach this class.

With a reasoning parser, a request whose prompt does not already close the reasoning generates freely until its
output contains the end marker (`</think>`); the grammar applies to what follows.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy
import numpy as np

from heteroserve.structured_output.grammar_compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class _Constrained:
    grammar: str
    matcher: llguidance.LLMatcher | None  # None while the request is still reasoning
    reasoning_end: list[int] = field(default_factory=list)  # the marker's token ids, while waiting for it
    recent: list[int] = field(default_factory=list)  # the output's last tokens, while waiting


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._requests: dict[str, _Constrained] = {}
        self._width = llguidance.numpy.get_bitmask_shape(1, compiler.tokenizer.vocab_size)[1]
        # Masks of a step are computed on every core, outside the GIL: ~0.2 ms each for a JSON string's wide mask.
        self._executor = llguidance.LLExecutor(num_threads=len(os.sched_getaffinity(0)))
        # ... from a thread of their own, so that they overlap the model's step (llguidance leaves the GIL).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, grammar: str, reasoning_end: list[int] | None = None) -> None:
        """Starts constraining a request: at once, or after `reasoning_end` (token ids) appears in its output."""
        matcher = None if reasoning_end else self.compiler.matcher(grammar)
        self._requests[request_id] = _Constrained(grammar, matcher, list(reasoning_end or []))

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
        """The next-token bitmask (int32 row) of each listed request that is constrained now (not reasoning).
        A complete grammar allows only an eos."""
        active = [(rid, self._requests[rid].matcher) for rid in request_ids if rid in self._requests]
        active = [(rid, m) for rid, m in active if m is not None]
        if not active:
            return {}
        masks = np.empty((len(active), self._width), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(matcher, row) for row, (_, matcher) in enumerate(active)], masks
        )
        return {rid: masks[row] for row, (rid, _) in enumerate(active)}

    def advance(self, request_id: str, token_ids: list[int]) -> None:
        """Feeds a request's newly kept tokens to its matcher (or to the wait for the end of reasoning)."""
        state = self._requests.get(request_id)
        if state is None:
            return
        for token in token_ids:
            if state.matcher is not None and state.matcher.is_stopped():
                # The grammar was complete and this is the eos it allowed; what follows (ignore_eos) is free.
                del self._requests[request_id]
                return
            if state.matcher is None:
                state.recent = (state.recent + [token])[-len(state.reasoning_end) :]
                if state.recent == state.reasoning_end:
                    state.matcher = self.compiler.matcher(state.grammar)
                continue
            if not state.matcher.consume_token(token):
                # Only a token the mask did not cover (an eos under min_tokens, say) gets here: stop constraining
                # rather than mask everything from now on.
                logger.warning(
                    "request %s: token %d breaks its grammar (%s); the rest of its output is unconstrained",
                    request_id,
                    token,
                    state.matcher.get_error().splitlines()[0] if state.matcher.get_error() else "no detail",
                )
                del self._requests[request_id]
                return
