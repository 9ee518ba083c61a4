"""Turns sampled tokens into `RequestOutput`s: detokenization, stop strings, logprobs, n > 1 fan-in."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from heteroserve.core.detokenizer import IncrementalDetokenizer
from heteroserve.core.request import Request
from heteroserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from heteroserve.sampling_params import RequestOutputKind


@dataclass
class ParentRequest:
    """The user's request when n > 1: children run as separate requests and are reported together."""

    request_id: str
    n: int
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0


@dataclass
class RequestState:
    request: Request
    prompt: str | None
    index: int
    parent: ParentRequest | None
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    num_tokens_reported: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, request: Request, prompt: str | None, index: int = 0, parent: ParentRequest | None = None) -> None:
        params = request.sampling_params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer._tokenizer,
                request.prompt_token_ids,
                params.stop_strings,
                params.skip_special_tokens,
                params.include_stop_str_in_output,
            )
        wants = params.logprobs is not None
        prompt_lp = [None] if params.prompt_logprobs is not None else None
        self.states[request.request_id] = RequestState(
            request, prompt, index, parent, detok, [] if wants else None, 0.0 if wants else None, prompt_lp
        )

    def add_token(self, request_id: str, token_id: int, logprobs: TokenLogprobs | None, num_output: int) -> bool:
        """Records one sampled token, the request's `num_output`-th; True when a stop string ended the request."""
        state = self.states[request_id]
        if logprobs is not None and state.logprobs is not None:
            state.logprobs.append(self._logprob_dict(logprobs))
            state.cumulative_logprob += logprobs.logprob
        if state.detokenizer is None:
            return False
        request = state.request
        stopped = state.detokenizer.add_token(token_id, num_output >= request.sampling_params.min_tokens)
        if stopped:
            request.stop_reason = state.detokenizer.stopped_by
        return stopped

    def add_prompt_logprobs(self, request_id: str, entries: list[TokenLogprobs]) -> None:
        state = self.states[request_id]
        needed = state.request.num_prompt_tokens - len(state.prompt_logprobs)
        state.prompt_logprobs.extend(self._logprob_dict(e) for e in entries[:needed])  # not again after preemption

    def make_output(self, request_id: str) -> RequestOutput | None:
        """The output to report now for this request (None when its output kind says wait)."""
        state = self.states[request_id]
        request = state.request
        kind = request.sampling_params.output_kind
        finished = request.status.finished
        if finished:
            del self.states[request_id]
        text = ""
        if state.detokenizer is not None:
            text = state.detokenizer.new_text(finished)
        tokens = request.output_token_ids
        if kind == RequestOutputKind.DELTA:
            new_tokens = tokens[state.num_tokens_reported :]
            logprobs = state.logprobs[state.num_tokens_reported :] if state.logprobs is not None else None
        else:
            text = state.detokenizer.visible_text if state.detokenizer is not None else ""
            new_tokens, logprobs = list(tokens), state.logprobs
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        state.num_tokens_reported = len(tokens)
        completion = CompletionOutput(
            index=state.index,
            text=text,
            token_ids=new_tokens,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            error=request.error,
        )
        return self._wrap(state, completion, finished)

    def _wrap(self, state: RequestState, completion: CompletionOutput, finished: bool) -> RequestOutput | None:
        request = state.request
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=request.finished_time,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            inter_token_gaps=request.inter_token_gaps,
        )
        request_id, outputs, all_done = request.request_id, [completion], finished
        parent = state.parent
        if parent is not None:
            request_id = parent.request_id
            parent.latest[state.index] = completion
            parent.num_finished += finished
            all_done = parent.num_finished == parent.n
            if request.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                if not all_done:
                    return None
                outputs = [parent.latest[i] for i in sorted(parent.latest)]
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=all_done,
            prompt_logprobs=state.prompt_logprobs,
            metrics=metrics,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        out = {entry.token_id: Logprob(entry.logprob, entry.rank, self._decode(entry.token_id))}
        for rank, (token, value) in enumerate(zip(entry.top_ids, entry.top_logprobs, strict=True), start=1):
            out.setdefault(token, Logprob(value, rank, self._decode(token)))
        return out

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])
