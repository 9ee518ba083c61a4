"""Continuous batching with a token budget.

Each request tracks how many of its tokens have KV computed; every step hands out up to
`max_num_batched_tokens` new tokens to running requests first, then to waiting ones. A prompt larger than
what is left of the budget is cut into chunks (chunked prefill), so prompt chunks and decodes share a step; a
pooling model's request is never cut (a bidirectional encoder and CLS / mean pooling need all its tokens at once)
and finishes in the step that computes it.
With LoRA, the requests running at once use at most `max_loras` adapters; a request whose adapter would be
one more waits, keeping its place, while later requests of the running adapters go ahead.
When KV blocks run out, the least urgent running request is preempted: its blocks are freed and it is
recomputed later from its tokens so far. With speculative decoding, a decoding request also computes its draft
tokens in the step; the drafts the model confirms are kept and the KV slots of the rest are written over later.
Drafts come from the n-gram proposer here, or from a draft model that runs beside the model (`lookahead_slots`:
a request that may draft holds that many slots past its step's tokens, where the draft model writes its own
drafts' keys).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from heteroserve.config import SchedulerConfig
from heteroserve.core.kv_cache_manager import KVCacheManager
from heteroserve.core.ngram_proposer import NgramProposer
from heteroserve.core.policy import POLICIES, RequestQueue
from heteroserve.core.prefill_limit import PrefillLimit
from heteroserve.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens to compute this step, starting at request.num_computed_tokens (drafts included)
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens after the known ones

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens + len(self.draft_token_ids)

    @property
    def decode_rows(self) -> bool:
        """Whether every token of this step attends to its own prefix as a decode does: a one-token step, or a
        decode token with drafts (the model runner lays these out as decode rows)."""
        return self.num_new_tokens == 1 or bool(self.draft_token_ids)

    @property
    def input_token_ids(self) -> list[int]:
        """The tokens this step computes: known ones, then the drafts."""
        known = self.request.token_ids[self.start : self.start + self.num_new_tokens]
        return known + self.draft_token_ids if self.draft_token_ids else known


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Structured outputs: request id -> the int32 bitmask row of the tokens its grammar allows next. The engine
    # computes it while the model runs; the sampler waits for it.
    token_bitmasks: Future[dict[str, Sequence[int]]] | None = None

    def bitmask_of(self, request_id: str) -> Sequence[int] | None:
        return self.token_bitmasks.result().get(request_id) if self.token_bitmasks is not None else None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    spec_draft_tokens: int  # speculative tokens checked so far
    spec_accepted_tokens: int  # of which the model confirmed
    spec_num_drafts: int = 0  # (request, step) pairs that checked drafts
    spec_accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts confirmed at position i
    step_token_counts: dict[int, int] = field(default_factory=dict)  # tokens in a step -> steps that ran that many
    running_lora_adapters: list[str] = field(default_factory=list)  # names of the adapters running requests use
    waiting_lora_adapters: list[str] = field(default_factory=list)  # and of those only waiting requests use


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        proposer: NgramProposer | None = None,
        lookahead_slots: int = 0,
    ) -> None:
        """proposer: n-gram drafts; lookahead_slots: with a draft model, the drafts it may write per request
        (its drafts arrive with the step's results instead)."""
        self.config = config
        self.kv_cache = kv_cache
        self.proposer = proposer
        self.lookahead_slots = lookahead_slots
        self.policy = POLICIES[config.policy]()
        self.prefill_limit = PrefillLimit(config.max_prefill_tokens_per_step)
        self.waiting = RequestQueue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_drafts = 0
        self.accepted_per_position: list[int] = []  # [i]: drafts confirmed as a request's i-th draft of a step
        self.step_token_counts: dict[int, int] = {}  # bounded: a step holds at most max_num_batched_tokens

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []
        if self.prefill_limit.max_tokens_per_step is not None:
            prefilling = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens > 1)
            self.prefill_limit.start_step(prefilling + len(self.waiting))

        def preempt(victim: Request) -> None:
            nonlocal budget
            if victim.request_id in scheduled:
                budget += scheduled.pop(victim.request_id).num_new_tokens
            self._preempt(victim)
            preempted.append(victim.request_id)

        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            prefilling = num_new > 1  # a prompt still prefilling in chunks
            if prefilling:
                num_new = self.prefill_limit.allowance(num_new)
                if num_new == 0:
                    continue
            drafts = request.draft_token_ids[: budget - 1] if num_new == 1 else []
            num_new += len(drafts)
            while not self.kv_cache.allocate_slots(request, num_new + self._lookahead(request, num_new)):
                victim = max(self.running, key=self.waiting.key_of)
                preempt(victim)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = ScheduledRequest(request, num_new, [], drafts)
                budget -= num_new
                if prefilling:
                    self.prefill_limit.take(num_new)

        running_preempted = bool(preempted)  # blocks ran short for running requests: admit no one new
        # The adapters running requests use (LoRA only: without it no request names one, and a step skips the walk).
        adapters = {r.lora_id for r in self.running if r.lora_id} if self.config.max_loras else set()
        set_aside: list[Request] = []  # waiting for an adapter slot: they keep their place in the queue
        while self.waiting and budget > 0 and not running_preempted:
            request = self.waiting.peek()
            if self._waits_for_leader(request):
                break
            if request.lora_id and request.lora_id not in adapters and len(adapters) >= (self.config.max_loras or 0):
                set_aside.append(self.waiting.pop())  # max_loras adapters are running: later ones may share them
                continue
            if len(self.running) >= self.config.max_num_seqs:
                victim = self._victim_for(request)
                if victim is None:
                    break
                preempt(victim)
            cached_blocks, num_cached = self.kv_cache.find_cached_prefix(request)
            num_new = request.num_tokens - num_cached
            whole = request.pooling_params is not None or not self.config.enable_chunked_prefill
            if whole and num_new > budget:  # a pooling request needs all its tokens in one step
                break
            num_new = self.prefill_limit.allowance(min(num_new, budget), whole)
            if num_new == 0:
                break
            lookahead = self._lookahead(request, num_new, num_cached)
            if not self.kv_cache.allocate_slots(request, num_new + lookahead, cached_blocks):
                victim = self._victim_for(request)
                if victim is None:
                    break
                preempt(victim)
                continue
            self.waiting.pop()
            self.kv_cache.record_prefix_lookup(request.num_tokens, num_cached)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora_id:
                adapters.add(request.lora_id)
            scheduled[request.request_id] = ScheduledRequest(request, num_new, [])
            budget -= num_new
            self.prefill_limit.take(num_new)
        for request in set_aside:
            self.waiting.push(request)

        for item in scheduled.values():
            item.block_ids = self.kv_cache.block_ids(item.request.request_id)
        num_tokens = self.config.max_num_batched_tokens - budget
        if num_tokens:
            self.step_token_counts[num_tokens] = self.step_token_counts.get(num_tokens, 0) + 1
        return SchedulerOutput(list(scheduled.values()), preempted)

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, list[int]], drafted: dict[str, list[int]] | None = None
    ) -> list[Request]:
        """Advances computed tokens, appends sampled tokens (the confirmed drafts, then the model's own next
        token), finishes requests that hit a stop rule, and takes the next drafts: the n-gram proposer's, or the
        draft model's (`drafted`, request id -> tokens after the sampled ones)."""
        finished = []
        now = time.time()
        for item in output.scheduled:
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue
            if request.pooling_params is not None:  # its whole prompt ran: the pooled result is its output
                request.num_computed_tokens += item.num_new_tokens
                self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                finished.append(request)
                continue
            tokens = sampled.get(request.request_id, [])
            accepted = max(len(tokens) - 1, 0)
            if item.draft_token_ids:
                self.num_drafts += 1
                self.num_draft_tokens += len(item.draft_token_ids)
                self.num_accepted_tokens += accepted
                if len(self.accepted_per_position) < len(item.draft_token_ids):
                    self.accepted_per_position += [0] * (len(item.draft_token_ids) - len(self.accepted_per_position))
                for position in range(accepted):
                    self.accepted_per_position[position] += 1
            request.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids) + accepted
            if tokens:
                if request.first_token_time is None:
                    request.first_token_time = now
                else:
                    request.inter_token_gaps.append(now - request.last_token_time)
                request.last_token_time = now
            status = None
            for token in tokens:
                request.append_output_token(token)
                status = self._stop_status(request, token)
                if status is not None:
                    break
            self.kv_cache.cache_computed_blocks(request)  # confirmed drafts are in token_ids now
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(request)
        if self.proposer is not None or drafted is not None:
            for request in self.running:
                request.draft_token_ids = self._propose(request, drafted)
        return finished

    @staticmethod
    def may_draft(request: Request) -> bool:
        """Whether drafts are checked for the request: greedy ones (a draft is confirmed when it equals the
        model's own choice) and sampled ones (speculative sampling keeps the model's distribution), but none under
        a grammar (each draft row would need a mask of the grammar advanced past the drafts before it)."""
        return request.sampling_params.structured_outputs is None and request.pooling_params is None

    def _lookahead(self, request: Request, num_new: int, num_cached: int | None = None) -> int:
        """Slots past a step's `num_new` tokens where a draft model writes the request's drafts: up to
        `lookahead_slots`, never past max_model_len."""
        if not self.lookahead_slots or not self.may_draft(request):
            return 0
        end = (request.num_computed_tokens if num_cached is None else num_cached) + num_new
        return max(0, min(self.lookahead_slots, self.config.max_model_len - end))

    def _propose(self, request: Request, drafted: dict[str, list[int]] | None) -> list[int]:
        """Drafts for a request that may take them and is decoding, short enough that every token they could add
        is one the request may still produce."""
        if not self.may_draft(request) or request.num_tokens - request.num_computed_tokens != 1:
            return []
        params = request.sampling_params
        limit = self.config.max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
        if drafted is not None:
            return drafted.get(request.request_id, [])[: max(limit, 0)]
        return self.proposer.propose(request, limit)

    def stop_at(self, request: Request, num_tokens: int) -> None:
        """Ends a request whose output a stop string ended within the tokens just appended: the tokens after its
        first `num_tokens` are dropped (they are not output) and, unless a stop rule already ended it, it
        finishes as stopped."""
        del request.token_ids[num_tokens:]
        request.num_computed_tokens = min(request.num_computed_tokens, num_tokens)
        if not request.status.finished:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (stop, length or abort) and frees its blocks; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.waiting.forget(request)
        request.status = status
        request.finished_time = time.time()
        request.draft_token_ids = []
        self.kv_cache.free(request)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        return request

    def stats(self) -> SchedulerStats:
        running = sorted({r.lora_request.lora_name for r in self.running if r.lora_request is not None})
        waiting = sorted({r.lora_request.lora_name for r in self.waiting if r.lora_request is not None})
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv_cache.usage,
            num_preemptions=self.num_preemptions,
            prefix_queries=self.kv_cache.stats.queries,
            prefix_hits=self.kv_cache.stats.hits,
            spec_draft_tokens=self.num_draft_tokens,
            spec_accepted_tokens=self.num_accepted_tokens,
            spec_num_drafts=self.num_drafts,
            spec_accepted_per_position=list(self.accepted_per_position),
            step_token_counts=dict(self.step_token_counts),  # a copy: the engine thread keeps counting
            running_lora_adapters=running,
            waiting_lora_adapters=[name for name in waiting if name not in running],
        )

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)

    def _victim_for(self, request: Request) -> Request | None:
        """A running request less urgent than `request` that the policy lets it preempt, if any."""
        if not self.policy.can_preempt_for_waiting or not self.running:
            return None
        victim = max(self.running, key=self.waiting.key_of)
        return victim if self.waiting.key_of(victim) > self.waiting.key_of(request) else None

    def _waits_for_leader(self, request: Request) -> bool:
        """Siblings of an n > 1 request wait until the first one's prompt is cached, then share its blocks."""
        leader = request.prefix_leader
        if leader is None or leader.status.finished or not self.kv_cache.enable_prefix_caching:
            return False
        return leader.num_computed_tokens < leader.num_prompt_tokens
