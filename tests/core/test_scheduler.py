"""The scheduler, driven without a model by a small simulation loop.

`Sim` plays the engine: schedule() -> "run the model" -> update_from_output(). The "model" is a fake KV
cache that records, for every slot written, the tokens whose KV it holds, and checks that every slot a step
reads holds the right KV. The "sampler" is a deterministic function of a request's tokens so far, so a
request's output does not depend on batching, chunking, prefix hits, preemption or speculative drafts: it can
be compared with the same request run alone.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from heteroserve.config import SchedulerConfig, SpeculativeConfig
from heteroserve.core.kv_cache_manager import KVCacheManager
from heteroserve.core.ngram_proposer import NgramProposer
from heteroserve.core.request import Request, RequestStatus
from heteroserve.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from heteroserve.sampling_params import SamplingParams

EOS = 2
Sampler = Callable[[Request], int]


def fake_token(token_ids: Sequence[int], vocab: int = 500) -> int:
    """The fake model's next token: a hash of every token so far, in [3, 3 + vocab)."""
    h = 17
    for token in token_ids:
        h = (h * 1_000_003 + token) & 0xFFFFFFFF
    return 3 + h % vocab


def fake_sampler(request: Request) -> int:
    return fake_token(request.token_ids)


@dataclass
class StepRecord:
    """One step as scheduled (a ScheduledRequest's `start` moves on once the step's output is applied)."""

    chunks: list[tuple[str, int, int]]  # (request id, first position, token count) of each scheduled request
    samples: list[bool]
    preempted: list[str]
    num_tokens: int

    @property
    def ids(self) -> list[str]:
        return [request_id for request_id, _, _ in self.chunks]


class Sim:
    """A scheduler, its KV cache manager and a fake model, with invariant checks after every step."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 64,
        enable_prefix_caching: bool = True,
        sampler: Sampler = fake_sampler,
        speculative: SpeculativeConfig | None = None,
        **scheduler_kwargs: object,
    ) -> None:
        self.config = SchedulerConfig(max_model_len=max_model_len, **scheduler_kwargs)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        proposer = NgramProposer(speculative) if speculative is not None else None
        self.scheduler = Scheduler(self.config, self.kv, proposer)
        self.sampler = sampler
        self.added: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}
        self.steps: list[StepRecord] = []
        self.schedule_order: list[str] = []  # request ids in the order they were first scheduled
        self.kv_slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> the prefix it encodes

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        *,
        priority: int = 0,
        eos_token_id: int | None = EOS,
        leader: Request | None = None,
        **params: object,
    ) -> Request:
        request = Request(request_id, list(prompt), SamplingParams(**params), eos_token_id, priority)
        request.prefix_leader = leader
        self.scheduler.add_request(request)
        self.added[request_id] = request
        check_invariants(self)
        return request

    def step(self, abort_before_update: Sequence[str] = ()) -> StepRecord:
        output = self.scheduler.schedule()
        record = StepRecord(
            [(item.request.request_id, item.start, item.num_new_tokens) for item in output.scheduled],
            [item.samples for item in output.scheduled],
            list(output.preempted),
            output.num_tokens,
        )
        self._check_schedule(output)
        self._run_fake_model(output)
        sampled = {item.request.request_id: self._verify(item) for item in output.scheduled if item.samples}
        for request_id in abort_before_update:
            self.abort(request_id)
        for request in self.scheduler.update_from_output(output, sampled):
            self._record_finished(request)
        self.steps.append(record)
        check_invariants(self)
        return record

    def abort(self, request_id: str) -> Request | None:
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if request is not None:
            assert request.status == RequestStatus.FINISHED_ABORTED
            self._record_finished(request)
        check_invariants(self)
        return request

    def run(self, max_steps: int = 5_000) -> int:
        """Steps until every request is finished; fails if that takes more than `max_steps` steps."""
        steps = 0
        while self.scheduler.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps <= max_steps, "the scheduler stopped making progress"
        return steps

    def _verify(self, item: ScheduledRequest) -> list[int]:
        """What a model runner returns: its token after each confirmed draft, stopping at the first mismatch."""
        tokens = []
        for j in range(len(item.draft_token_ids) + 1):
            view = copy.copy(item.request)  # the request as if drafts [0, j) had been sampled
            view.token_ids = item.request.token_ids + item.draft_token_ids[:j]
            tokens.append(self.sampler(view))
            if j < len(item.draft_token_ids) and tokens[-1] != item.draft_token_ids[j]:
                break
        return tokens

    def _record_finished(self, request: Request) -> None:
        assert request.status.finished
        assert request.request_id not in self.finished, f"{request.request_id} reported finished twice"
        self.finished[request.request_id] = request

    def _check_schedule(self, output: SchedulerOutput) -> None:
        config, scheduler = self.config, self.scheduler
        assert output.num_tokens <= config.max_num_batched_tokens
        ids = [item.request.request_id for item in output.scheduled]
        assert len(ids) == len(set(ids))
        assert len(scheduler.running) <= config.max_num_seqs
        for item in output.scheduled:
            request = item.request
            assert request.status == RequestStatus.RUNNING and request in scheduler.running
            assert item.num_new_tokens >= 1
            assert item.start + item.num_new_tokens <= request.num_tokens + len(item.draft_token_ids)
            assert not item.draft_token_ids or item.start == request.num_tokens - 1, "drafts only while decoding"
            assert item.block_ids == self.kv.block_ids(request.request_id)
            assert len(item.block_ids) >= self.kv.blocks_needed(item.start + item.num_new_tokens)
            if not config.enable_chunked_prefill:
                assert item.samples, "without chunked prefill every scheduled request computes all its tokens"
            if request.request_id not in self.schedule_order:
                self.schedule_order.append(request.request_id)
        for request_id in output.preempted:
            request = self.added[request_id]
            if request_id not in ids:
                assert request.status == RequestStatus.PREEMPTED
                assert request.num_computed_tokens == 0
                assert self.kv.block_ids(request_id) == []

    def _run_fake_model(self, output: SchedulerOutput) -> None:
        """Reads the KV of every earlier position and writes the KV of the new ones."""
        size = self.block_size
        for item in output.scheduled:
            request, blocks = item.request, item.block_ids
            tokens = request.token_ids + item.draft_token_ids
            for pos in range(item.start):
                held = self.kv_slots.get((blocks[pos // size], pos % size))
                assert held == tuple(tokens[: pos + 1]), f"{request.request_id} reads wrong KV at position {pos}"
            for pos in range(item.start, item.start + item.num_new_tokens):
                block = self.kv.pool.blocks[blocks[pos // size]]
                assert block.ref_count == 1, f"{request.request_id} writes into shared block {block.block_id}"
                assert block.block_hash is None, f"{request.request_id} writes into cached block {block.block_id}"
                self.kv_slots[(block.block_id, pos % size)] = tuple(tokens[: pos + 1])


def check_invariants(sim: Sim) -> None:
    scheduler, kv = sim.scheduler, sim.kv
    pool = kv.pool

    # Block ownership and reference counts.
    owners: Counter[int] = Counter()
    for request_id, blocks in kv._blocks.items():
        request = scheduler.requests.get(request_id)
        assert request is not None, f"finished request {request_id} still owns blocks"
        assert request.status == RequestStatus.RUNNING, f"{request_id} owns blocks while {request.status.name}"
        assert blocks, f"{request_id} has an empty block table"
        assert len({b.block_id for b in blocks}) == len(blocks)
        assert len(blocks) >= kv.blocks_needed(request.num_computed_tokens)
        owners.update(b.block_id for b in blocks)
    free = list(pool._free)
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert sum(b.ref_count for b in pool.blocks) == sum(owners.values())
    for block in pool.blocks:
        assert block.ref_count == owners[block.block_id], f"block {block.block_id} has a wrong ref_count"
        assert (block.block_id in pool._free) == (block.ref_count == 0), f"block {block.block_id} free and used"
        if owners[block.block_id] > 1:
            assert block.block_id not in pool._free
        if block.block_hash is not None:
            assert pool._cached[block.block_hash] is block
    assert all(block.block_hash == h for h, block in pool._cached.items())
    assert pool.num_used_blocks + pool.num_free_blocks == pool.num_blocks

    # Request states: every request is running, waiting or finished, exactly once.
    running = {r.request_id for r in scheduler.running}
    waiting = {r.request_id for r in scheduler.waiting}
    assert len(running) == len(scheduler.running) and len(waiting) == len(scheduler.waiting)
    assert not running & waiting
    assert running | waiting == set(scheduler.requests)
    assert len(scheduler.running) <= sim.config.max_num_seqs
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        assert request.num_computed_tokens < request.num_tokens
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0
        assert request.request_id not in kv._blocks
    assert set(sim.added) == set(scheduler.requests) | set(sim.finished)
    assert not set(scheduler.requests) & set(sim.finished)
    assert all(request.status.finished for request in sim.finished.values())


def expected_output(
    prompt: Sequence[int],
    params: SamplingParams,
    max_model_len: int,
    eos_token_id: int | None = EOS,
    vocab: int = 500,
) -> tuple[list[int], str]:
    """What a request produces when run alone: its output tokens and finish reason, from the stop rules."""
    tokens = list(prompt)
    while True:
        token = fake_token(tokens, vocab)
        tokens.append(token)
        num_output = len(tokens) - len(prompt)
        if num_output >= params.min_tokens and (
            (not params.ignore_eos and token == eos_token_id) or token in params.stop_token_ids
        ):
            return tokens[len(prompt) :], "stop"
        if (params.max_tokens is not None and num_output >= params.max_tokens) or len(tokens) >= max_model_len:
            return tokens[len(prompt) :], "length"


def run_alone(prompt: Sequence[int], max_model_len: int = 64, **params: object) -> list[int]:
    """The output of a request run alone with a huge KV cache; checked against `expected_output` too."""
    sim = Sim(num_blocks=1024, max_model_len=max_model_len)
    request = sim.add("alone", prompt, **params)
    sim.run()
    tokens, reason = expected_output(prompt, request.sampling_params, max_model_len)
    assert (request.output_token_ids, request.status.finish_reason) == (tokens, reason)
    return request.output_token_ids


# --- token budget, chunked prefill, admission ---------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    sim = Sim(max_num_batched_tokens=8)
    request = sim.add("a", range(3, 23), max_tokens=3)

    steps = [sim.step() for _ in range(5)]

    assert [s.chunks for s in steps] == [
        [("a", 0, 8)],
        [("a", 8, 8)],
        [("a", 16, 4)],
        [("a", 20, 1)],
        [("a", 21, 1)],
    ]
    assert [s.samples for s in steps] == [
        [False],
        [False],
        [True],
        [True],
        [True],
    ]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == run_alone(range(3, 23), max_tokens=3)


def test_chunked_prefill_mixes_with_decodes() -> None:
    sim = Sim(max_num_batched_tokens=8)
    sim.add("a", [3, 4, 5], max_tokens=10)
    assert sim.step().chunks == [("a", 0, 3)]
    sim.add("b", range(10, 30), max_tokens=2)

    steps = [sim.step() for _ in range(3)]

    assert [s.chunks for s in steps] == [
        [("a", 3, 1), ("b", 0, 7)],
        [("a", 4, 1), ("b", 7, 7)],
        [("a", 5, 1), ("b", 14, 6)],
    ]
    assert steps[2].samples[1]
    sim.run()
    assert sim.added["b"].output_token_ids == run_alone(range(10, 30), max_tokens=2)


def test_budget_is_shared_in_arrival_order() -> None:
    sim = Sim(max_num_batched_tokens=10)
    for i, name in enumerate("abc"):
        sim.add(name, range(10 * i + 5, 10 * i + 11), max_tokens=2)

    assert sim.step().chunks == [("a", 0, 6), ("b", 0, 4)]
    assert sim.step().chunks == [("a", 6, 1), ("b", 4, 2), ("c", 0, 6)]


def test_without_chunked_prefill_a_prompt_is_scheduled_whole() -> None:
    sim = Sim(max_model_len=32, max_num_batched_tokens=32, enable_chunked_prefill=False)
    sim.add("a", range(3, 23), max_tokens=4)
    sim.add("b", range(30, 50), max_tokens=4)

    assert sim.step().chunks == [("a", 0, 20)]  # b's 20 tokens do not fit in the 12 left
    assert sim.step().chunks == [("a", 20, 1), ("b", 0, 20)]
    sim.run()
    assert sim.added["b"].output_token_ids == run_alone(range(30, 50), max_tokens=4)


def test_with_chunked_prefill_the_same_prompt_is_cut() -> None:
    sim = Sim(max_model_len=32, max_num_batched_tokens=32, enable_chunked_prefill=True)
    sim.add("a", range(3, 23), max_tokens=4)
    sim.add("b", range(30, 50), max_tokens=4)

    assert sim.step().chunks == [("a", 0, 20), ("b", 0, 12)]


def test_without_chunked_prefill_the_budget_must_cover_max_model_len() -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_model_len \(32\)"):
        SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=32)
    default = SchedulerConfig(enable_chunked_prefill=False, max_model_len=32)
    assert default.max_num_batched_tokens == 32


def test_new_requests_join_at_the_next_step() -> None:
    sim = Sim(max_num_batched_tokens=64)
    sim.add("a", [3, 4, 5, 6], max_tokens=5)
    assert sim.step().ids == ["a"]

    sim.add("b", [7, 8, 9], max_tokens=5)
    second = sim.step()

    assert second.chunks == [("a", 4, 1), ("b", 0, 3)]


def test_max_num_seqs_limits_running_requests() -> None:
    sim = Sim(max_num_seqs=2)
    for name in "abc":
        sim.add(name, [3, 4, 5], max_tokens=3)

    first = sim.step()
    assert first.ids == ["a", "b"]
    assert [r.request_id for r in sim.scheduler.waiting] == ["c"]
    while "a" not in sim.finished:
        assert "c" not in sim.step().ids
    assert "c" in sim.step().ids
    sim.run()
    assert max(len(s.chunks) for s in sim.steps) == 2


def test_duplicate_request_id_is_rejected() -> None:
    sim = Sim()
    sim.add("a", [3])
    with pytest.raises(ValueError, match="'a' is already in use"):
        sim.add("a", [4])


def test_stats() -> None:
    sim = Sim(num_blocks=10, max_num_seqs=1)
    sim.add("a", [3, 4, 5, 6, 7], max_tokens=3)
    sim.add("b", [3, 4, 5, 6, 8], max_tokens=3)
    sim.step()
    stats = sim.scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (1, 1, 0)
    assert stats.kv_usage == pytest.approx(0.2)
    assert (stats.prefix_queries, stats.prefix_hits) == (5, 0)
    sim.run()
    stats = sim.scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)
    assert (stats.prefix_queries, stats.prefix_hits) == (10, 4)


# --- stop rules -----------------------------------------------------------------------------------------


def eos_at(index: int, token: int = EOS) -> Sampler:
    """A sampler that emits `token` as output number `index` (0-based) and from then on."""
    return lambda request: token if request.num_output_tokens >= index else fake_sampler(request)


def test_max_tokens_finishes_with_length() -> None:
    sim = Sim()
    request = sim.add("a", [3, 4, 5], max_tokens=5)
    sim.run()
    assert request.num_output_tokens == 5
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.status.finish_reason == "length"
    assert sim.finished == {"a": request}


def test_max_model_len_finishes_with_length() -> None:
    sim = Sim(max_model_len=10)
    request = sim.add("a", [3, 4, 5, 6, 7, 8, 9], max_tokens=None)
    sim.run()
    assert request.num_tokens == 10 and request.num_output_tokens == 3
    assert request.status.finish_reason == "length"


def test_eos_finishes_with_stop() -> None:
    sim = Sim(sampler=eos_at(3))
    request = sim.add("a", [3, 4, 5], max_tokens=10)
    sim.run()
    assert request.num_output_tokens == 4
    assert request.output_token_ids[-1] == EOS and EOS not in request.output_token_ids[:-1]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.status.finish_reason == "stop"
    assert request.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    sim = Sim(sampler=eos_at(3))
    request = sim.add("a", [3, 4, 5], max_tokens=8, ignore_eos=True)
    sim.run()
    assert request.num_output_tokens == 8
    assert request.output_token_ids[3:] == [EOS] * 5
    assert request.status.finish_reason == "length"


def test_request_without_eos_token_is_not_stopped_by_it() -> None:
    sim = Sim(sampler=eos_at(0))
    request = sim.add("a", [3, 4], max_tokens=4, eos_token_id=None)
    sim.run()
    assert request.output_token_ids == [EOS] * 4
    assert request.status.finish_reason == "length"


@pytest.mark.parametrize("min_tokens", [0, 1, 3, 6])
def test_min_tokens_delays_eos(min_tokens: int) -> None:
    sim = Sim(sampler=eos_at(0))
    request = sim.add("a", [3, 4, 5], max_tokens=6, min_tokens=min_tokens)
    sim.run()
    assert request.num_output_tokens == max(min_tokens, 1)
    assert request.status.finish_reason == "stop"


def test_stop_token_ids_finish_with_stop_and_record_the_token() -> None:
    sim = Sim(sampler=eos_at(2, token=42))
    request = sim.add("a", [3, 4, 5], max_tokens=10, stop_token_ids=[41, 42], ignore_eos=True)
    sim.run()
    assert request.output_token_ids[-1] == 42 and request.num_output_tokens == 3
    assert request.status.finish_reason == "stop"
    assert request.stop_reason == 42


def test_min_tokens_delays_stop_token_ids() -> None:
    sim = Sim(sampler=eos_at(0, token=42))
    request = sim.add("a", [3, 4, 5], max_tokens=10, min_tokens=4, stop_token_ids=[42])
    sim.run()
    assert request.output_token_ids == [42] * 4
    assert request.stop_reason == 42


def test_stop_beats_length_on_the_same_token() -> None:
    sim = Sim(sampler=eos_at(2))
    request = sim.add("a", [3, 4, 5], max_tokens=3)
    sim.run()
    assert request.num_output_tokens == 3
    assert request.status.finish_reason == "stop"


# --- preemption ---------------------------------------------------------------------------------------


def test_preempted_request_returns_to_the_front_of_the_queue() -> None:
    # 4 blocks of 2 tokens: a and b fit at first, then b is preempted as they grow.
    sim = Sim(num_blocks=4, block_size=2, max_model_len=8)
    a = sim.add("a", [3, 4, 5, 6], max_tokens=4)
    b = sim.add("b", [7, 8, 9, 10], max_tokens=4)
    sim.add("c", [11, 12, 13, 14], max_tokens=4)  # arrives before b is preempted
    assert sim.step().ids == ["a", "b"]  # the 4 blocks are full, c cannot start

    output = sim.step()  # a and b both need a third block: b, the later arrival, gives way

    assert output.preempted == ["b"]
    assert output.ids == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert [r.request_id for r in sim.scheduler.waiting] == ["b", "c"]
    assert sim.scheduler.num_preemptions == 1
    sim.run()
    assert sim.schedule_order == ["a", "b", "c"]
    for request in (a, b, sim.added["c"]):
        assert request.output_token_ids == run_alone(request.prompt_token_ids, max_model_len=8, max_tokens=4)


@pytest.mark.parametrize("block_size", [1, 2, 4])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_by_recompute_gives_the_same_tokens(block_size: int, enable_prefix_caching: bool) -> None:
    max_model_len = 24
    sim = Sim(
        num_blocks=max_model_len // block_size,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=8,
        enable_prefix_caching=enable_prefix_caching,
    )
    prompts = {f"r{i}": [3 + i, 4, 5, 6 + i, 7][: 2 + i] for i in range(4)}
    for request_id, prompt in prompts.items():
        sim.add(request_id, prompt, max_tokens=14)

    preempted_once: set[str] = set()
    while sim.scheduler.has_unfinished_requests():
        output = sim.step()
        preempted_once.update(output.preempted)
        waiting = list(sim.scheduler.waiting)
        was_scheduled = [r.first_scheduled_time is not None for r in waiting]
        assert was_scheduled == sorted(was_scheduled, reverse=True), "a preempted request queues behind a new one"

    assert sim.scheduler.num_preemptions > 0 and preempted_once
    for request_id, prompt in prompts.items():
        request = sim.added[request_id]
        assert request.output_token_ids == run_alone(prompt, max_model_len=max_model_len, max_tokens=14)
        assert request.status.finish_reason == "length"
    assert sum(r.num_preemptions for r in sim.added.values()) == sim.scheduler.num_preemptions
    assert sim.kv.pool.num_free_blocks == sim.kv.pool.num_blocks


def test_fcfs_preempts_the_latest_arrival() -> None:
    sim = Sim(num_blocks=6, block_size=2, max_model_len=12)
    for name in "abc":
        sim.add(name, [3, 4, 5, 6], max_tokens=8)
    assert sim.step().ids == ["a", "b", "c"]  # 6 blocks in use
    output = sim.step()
    assert output.preempted == ["c"]
    assert output.ids == ["a", "b"]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preempted_request_resumes_from_its_own_cached_blocks(enable_prefix_caching: bool) -> None:
    sim = Sim(num_blocks=8, block_size=2, max_model_len=16, enable_prefix_caching=enable_prefix_caching)
    a = sim.add("a", [3, 4, 5, 6], max_tokens=4)
    b = sim.add("b", range(7, 15), max_tokens=4)
    assert sim.step().chunks == [("a", 0, 4), ("b", 0, 8)]
    assert sim.step().chunks == [("a", 4, 1), ("b", 8, 1)]  # 8 blocks in use
    assert sim.step().chunks == [("a", 5, 1), ("b", 9, 1)]

    fourth = sim.step()  # a needs a 4th block: b gives way, and its 5 computed blocks stay cached

    assert fourth.preempted == ["b"] and fourth.chunks == [("a", 6, 1)]
    assert a.status == RequestStatus.FINISHED_LENGTH
    # a took one of b's freed blocks (the last); the other 4 still hold b's KV.
    expected_start = 8 if enable_prefix_caching else 0
    assert sim.step().chunks == [("b", expected_start, 11 - expected_start)]
    sim.run()
    assert b.output_token_ids == run_alone(range(7, 15), max_model_len=16, max_tokens=4)


# --- priority policy ----------------------------------------------------------------------------------


def test_priority_policy_runs_lower_values_first_fcfs_within_a_priority() -> None:
    sim = Sim(policy="priority", max_num_seqs=1)
    for name, priority in [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2)]:
        sim.add(name, [3, 4], priority=priority, max_tokens=2)
    sim.run()
    assert sim.schedule_order == ["b", "d", "c", "a", "e"]


def test_fcfs_policy_ignores_priority() -> None:
    sim = Sim(policy="fcfs", max_num_seqs=1)
    for name, priority in [("a", 2), ("b", 0), ("c", 1)]:
        sim.add(name, [3, 4], priority=priority, max_tokens=2)
    sim.run()
    assert sim.schedule_order == ["a", "b", "c"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_urgent_arrival_and_seq_slots(policy: str) -> None:
    sim = Sim(policy=policy, max_num_seqs=1)
    a = sim.add("a", [3, 4, 5], priority=1, max_tokens=6)
    sim.step()
    sim.step()
    b = sim.add("b", [6, 7], priority=0, max_tokens=2)

    output = sim.step()

    if policy == "priority":
        assert output.preempted == ["a"]
        assert output.chunks == [("b", 0, 2)]
        assert a.status == RequestStatus.PREEMPTED
        assert [r.request_id for r in sim.scheduler.waiting] == ["a"]
    else:
        assert output.preempted == []
        assert output.ids == ["a"]
    sim.run()
    if policy == "priority":
        assert b.finished_time <= a.finished_time
    else:
        assert a.finished_time <= b.finished_time
    assert a.output_token_ids == run_alone([3, 4, 5], max_tokens=6)
    assert b.output_token_ids == run_alone([6, 7], max_tokens=2)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_urgent_arrival_and_kv_blocks(policy: str) -> None:
    # 4 blocks of 4 tokens: a grows to hold all of them, then b needs 2.
    sim = Sim(policy=policy, num_blocks=4, block_size=4, max_model_len=16)
    a = sim.add("a", range(3, 15), priority=1, max_tokens=4)
    sim.step()  # a: 12 prompt tokens computed, 3 blocks
    b = sim.add("b", range(20, 28), priority=0, max_tokens=2)

    output = sim.step()  # a takes the 4th block for its 13th token; b finds none left

    if policy == "priority":
        assert output.preempted == ["a"]
        assert output.chunks == [("b", 0, 8)], "the urgent request runs in the step that preempts for it"
        assert a.status == RequestStatus.PREEMPTED
    else:
        assert output.preempted == []
        assert output.chunks == [("a", 12, 1)]
        assert b.status == RequestStatus.WAITING
    sim.run()
    assert a.output_token_ids == run_alone(range(3, 15), max_model_len=16, max_tokens=4)
    assert b.output_token_ids == run_alone(range(20, 28), max_model_len=16, max_tokens=2)


def test_a_preempted_request_gives_back_its_share_of_the_budget() -> None:
    sim = Sim(policy="priority", num_blocks=4, block_size=4, max_model_len=16, max_num_batched_tokens=16)
    a = sim.add("a", range(3, 15), priority=1, max_tokens=4)
    sim.step()
    sim.add("b", range(20, 36), priority=0, max_tokens=1)  # 16 tokens: all 4 blocks and the whole budget

    output = sim.step()  # a is scheduled for 1 token, then preempted: b gets the full budget back

    assert output.preempted == ["a"]
    assert output.chunks == [("b", 0, 16)]
    sim.run()
    assert a.output_token_ids == run_alone(range(3, 15), max_model_len=16, max_tokens=4)


def test_equal_priority_does_not_preempt() -> None:
    sim = Sim(policy="priority", max_num_seqs=1)
    sim.add("a", [3, 4, 5], priority=1, max_tokens=4)
    sim.step()
    sim.add("b", [6, 7], priority=1, max_tokens=2)
    while sim.scheduler.has_unfinished_requests():
        assert sim.step().preempted == []
    assert sim.schedule_order == ["a", "b"]


def test_running_requests_preempt_the_least_urgent_first() -> None:
    sim = Sim(policy="priority", num_blocks=6, block_size=2, max_model_len=12)
    sim.add("low", [3, 4, 5, 6], priority=2, max_tokens=8)
    sim.add("high", [7, 8, 9, 10], priority=0, max_tokens=8)
    sim.add("mid", [11, 12, 13, 14], priority=1, max_tokens=8)
    assert sim.step().ids == ["high", "mid", "low"]
    output = sim.step()
    assert output.preempted == ["low"]
    sim.run()
    assert sim.finished["high"].num_preemptions == 0


# --- abort ----------------------------------------------------------------------------------------------


def _advance_to(sim: Sim, request: Request, phase: str) -> None:
    if phase == "waiting":
        return
    if phase == "prefill":
        sim.step()
        assert 0 < request.num_computed_tokens < request.num_prompt_tokens
    elif phase == "decode":
        while request.num_output_tokens < 2:
            sim.step()
    elif phase == "preempted":
        while request.status != RequestStatus.PREEMPTED:
            sim.step()
    assert request.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED)


@pytest.mark.parametrize("phase", ["waiting", "prefill", "decode", "preempted"])
def test_abort_frees_blocks_at_any_time(phase: str) -> None:
    sim = Sim(num_blocks=6, block_size=2, max_model_len=12, max_num_batched_tokens=4)
    other = sim.add("other", [3, 4, 5], max_tokens=9)
    request = sim.add("victim", [6, 7, 8, 9, 10], max_tokens=7)
    _advance_to(sim, request, phase)

    aborted = sim.abort("victim")

    assert aborted is request
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert request.status.finish_reason == "abort"
    assert request.finished_time is not None
    assert sim.kv.block_ids("victim") == []
    assert "victim" not in sim.scheduler.requests
    assert request not in sim.scheduler.running and request not in list(sim.scheduler.waiting)
    assert sim.kv.pool.num_used_blocks == len(sim.kv.block_ids("other"))
    assert sim.abort("victim") is None  # a second abort is ignored
    sim.run()
    assert other.output_token_ids == run_alone([3, 4, 5], max_model_len=12, max_tokens=9)
    assert sim.kv.pool.num_free_blocks == 6


def test_abort_between_schedule_and_update() -> None:
    sim = Sim()
    a = sim.add("a", [3, 4, 5], max_tokens=5)
    b = sim.add("b", [6, 7, 8], max_tokens=5)
    sim.step()
    sim.step(abort_before_update=["a"])  # the step's output arrives for a request that is gone
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.num_output_tokens == 1
    sim.run()
    assert b.output_token_ids == run_alone([6, 7, 8], max_tokens=5)


def test_abort_unknown_request_is_ignored() -> None:
    sim = Sim()
    assert sim.scheduler.finish_request("nope", RequestStatus.FINISHED_ABORTED) is None


# --- n > 1 siblings -------------------------------------------------------------------------------------


def test_siblings_wait_for_the_leaders_prompt_then_share_its_blocks() -> None:
    sim = Sim(block_size=4, max_num_batched_tokens=8)
    prompt = list(range(3, 13))  # 10 tokens: 2 full blocks and 2 tokens
    leader = sim.add("0_r", prompt, max_tokens=3)
    siblings = [sim.add(f"{i}_r", prompt, max_tokens=3, leader=leader) for i in (1, 2)]

    assert sim.step().chunks == [("0_r", 0, 8)]
    assert sim.step().chunks == [("0_r", 8, 2)]  # budget is left, but the leader's prompt is not done
    third = sim.step()

    assert third.chunks == [("0_r", 10, 1), ("1_r", 8, 2), ("2_r", 8, 2)]
    shared = sim.kv.block_ids("0_r")[:2]
    for sibling in siblings:
        assert sibling.num_cached_tokens == 8
        assert sim.kv.block_ids(sibling.request_id)[:2] == shared
        assert sim.kv.block_ids(sibling.request_id)[2] not in sim.kv.block_ids("0_r")
    assert [sim.kv.pool.blocks[i].ref_count for i in shared] == [3, 3]
    assert (sim.kv.stats.queries, sim.kv.stats.hits) == (30, 16)
    sim.run()
    for request in [leader, *siblings]:
        assert request.output_token_ids == run_alone(prompt, max_tokens=3)


def test_siblings_do_not_wait_without_prefix_caching() -> None:
    sim = Sim(block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False)
    prompt = list(range(3, 13))
    leader = sim.add("0_r", prompt, max_tokens=3)
    sim.add("1_r", prompt, max_tokens=3, leader=leader)
    assert sim.step().chunks == [("0_r", 0, 10), ("1_r", 0, 2)]


def test_siblings_of_an_aborted_leader_do_not_wait() -> None:
    sim = Sim(block_size=4, max_num_batched_tokens=8)
    prompt = list(range(3, 13))
    leader = sim.add("0_r", prompt, max_tokens=3)
    sibling = sim.add("1_r", prompt, max_tokens=3, leader=leader)
    sim.step()
    sim.abort("0_r")
    assert sim.step().chunks == [("1_r", 8, 2)]  # the aborted leader's computed blocks stay cached
    sim.run()
    assert sibling.output_token_ids == run_alone(prompt, max_tokens=3)


def test_prefix_hits_across_requests() -> None:
    sim = Sim(block_size=4)
    prompt = list(range(3, 15))  # exactly 3 blocks
    sim.add("a", prompt, max_tokens=2)
    sim.run()
    b = sim.add("b", prompt, max_tokens=2)
    assert sim.step().chunks == [("b", 8, 4)]  # the last block is recomputed for the last prompt token
    assert b.num_cached_tokens == 8
    c = sim.add("c", prompt + [99], max_tokens=2)
    assert sim.step().chunks == [("b", 12, 1), ("c", 12, 1)]
    assert c.num_cached_tokens == 12
    sim.run()
    assert b.output_token_ids == sim.finished["a"].output_token_ids


# --- random workloads -------------------------------------------------------------------------------------


@dataclass
class SimConfig:
    block_size: int
    max_model_len: int
    num_blocks: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_num_seqs: int
    enable_prefix_caching: bool
    policy: str
    speculative: SpeculativeConfig | None
    max_prefill_tokens_per_step: int | None


@st.composite
def speculative_configs(draw: st.DrawFn) -> SpeculativeConfig:
    longest = draw(st.integers(1, 4))
    return SpeculativeConfig(
        num_speculative_tokens=draw(st.integers(1, 5)),
        prompt_lookup_max=longest,
        prompt_lookup_min=draw(st.integers(1, longest)),
    )


@st.composite
def sim_configs(draw: st.DrawFn) -> SimConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(2, 40))
    num_blocks = -(-max_model_len // block_size) + draw(st.integers(0, 6))  # one request always fits
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 24)) if chunked else max_model_len + draw(st.integers(0, 8))
    return SimConfig(
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        max_num_seqs=draw(st.integers(1, 4)),
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        speculative=draw(st.none() | speculative_configs()),
        max_prefill_tokens_per_step=draw(st.none() | st.integers(1, 16)),
    )


@dataclass
class Add:
    tokens: list[int]
    shared_prefix: tuple[int, int] | None  # (which earlier prompt, how many of its tokens)
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    priority: int
    n: int


@dataclass
class Step:
    count: int


@dataclass
class Abort:
    which: int


adds = st.builds(
    Add,
    tokens=st.lists(st.integers(3, 6), min_size=1, max_size=40),  # a tiny alphabet: prefixes repeat
    shared_prefix=st.none() | st.tuples(st.integers(0, 50), st.integers(1, 40)),
    max_tokens=st.none() | st.integers(1, 12),
    min_tokens=st.integers(0, 3),
    ignore_eos=st.booleans(),
    priority=st.integers(0, 2),
    n=st.sampled_from([1, 1, 2, 3]),
)
steps = st.builds(Step, st.integers(1, 4))
aborts = st.builds(Abort, st.integers(0, 50))
operations = st.lists(st.one_of(adds, steps, adds, steps, aborts), min_size=6, max_size=40)
FAKE_VOCAB = 20  # fake tokens in [3, 23): EOS and the stop token come up every ten tokens or so
FAKE_EOS = 5
STOP_TOKEN = 7


def fake_small_vocab(request: Request) -> int:
    return fake_token(request.token_ids, FAKE_VOCAB)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=sim_configs(), ops=operations, finish_by_abort=st.sampled_from([False, False, True]))
def test_random_workloads_keep_the_invariants(
    config: SimConfig, ops: list[Add | Step | Abort], finish_by_abort: bool
) -> None:
    """Invariants are checked after every add, step and abort (see `Sim`); outputs match a solo run."""
    sim = Sim(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        sampler=fake_small_vocab,
        speculative=config.speculative,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
        max_num_seqs=config.max_num_seqs,
        policy=config.policy,
        max_prefill_tokens_per_step=config.max_prefill_tokens_per_step,
    )
    prompts: list[list[int]] = []
    ids: list[str] = []
    for op in ops:
        if isinstance(op, Add):
            prompt = list(op.tokens)
            if op.shared_prefix is not None and prompts:
                which, length = op.shared_prefix
                prompt = prompts[which % len(prompts)][:length] + prompt
            prompt = prompt[: config.max_model_len]
            prompts.append(prompt)
            max_tokens = op.max_tokens
            params = {
                "max_tokens": max_tokens,
                "min_tokens": min(op.min_tokens, max_tokens or op.min_tokens),
                "ignore_eos": op.ignore_eos,
                "stop_token_ids": [STOP_TOKEN],
                "temperature": 0,  # greedy, so that speculative configs propose drafts
            }
            leader = None
            for i in range(op.n):
                request_id = f"{i}_{len(prompts)}"
                request = sim.add(
                    request_id, prompt, priority=op.priority, eos_token_id=FAKE_EOS, leader=leader, **params
                )
                leader = leader or request
                ids.append(request_id)
        elif isinstance(op, Step):
            for _ in range(op.count):
                sim.step()
        elif ids:
            sim.abort(ids[op.which % len(ids)])

    if finish_by_abort:
        for request_id in list(sim.scheduler.requests):
            sim.abort(request_id)
    else:
        sim.run(max_steps=20_000)

    # Coverage, shown by --hypothesis-show-statistics.
    event("preemptions" if sim.scheduler.num_preemptions else "no preemption")
    event("prefix hits" if sim.kv.stats.hits else "no prefix hit")
    if config.speculative is not None:
        event("drafts confirmed" if sim.scheduler.num_accepted_tokens else "no draft confirmed")
    for request in sim.finished.values():
        event(f"finish: {request.status.finish_reason}")

    assert not sim.scheduler.requests and not sim.scheduler.running and not sim.scheduler.waiting
    assert sim.kv._blocks == {}
    assert sim.kv.pool.num_free_blocks == sim.kv.pool.num_blocks
    assert sorted(sim.finished) == sorted(ids)
    for request in sim.finished.values():
        tokens, reason = expected_output(
            request.prompt_token_ids, request.sampling_params, config.max_model_len, FAKE_EOS, FAKE_VOCAB
        )
        if request.status == RequestStatus.FINISHED_ABORTED:
            assert request.output_token_ids == tokens[: request.num_output_tokens]
        else:
            assert request.output_token_ids == tokens
            assert request.status.finish_reason == reason


# --- speculative decoding (n-gram drafts) ---------------------------------------------------------------

PERIOD = 4


def periodic(request: Request) -> int:
    """A model that repeats the token PERIOD places back: n-gram drafts of it are always right."""
    return request.token_ids[-PERIOD]


def plain_and_speculative(sampler: Sampler, prompt: list[int], drafts: int, max_tokens: int) -> tuple[Request, Sim]:
    """The request's output without speculation, and a simulation that ran it with up to `drafts` drafts."""
    plain = Sim(sampler=sampler)
    alone = plain.add("a", prompt, max_tokens=max_tokens, temperature=0)
    plain.run()
    sim = Sim(sampler=sampler, speculative=SpeculativeConfig(num_speculative_tokens=drafts))
    sim.add("a", prompt, max_tokens=max_tokens, temperature=0)
    sim.run()
    return alone, sim


def test_confirmed_drafts_advance_several_tokens_a_step() -> None:
    alone, sim = plain_and_speculative(periodic, [3, 4, 5, 6] * 3, drafts=3, max_tokens=10)
    request = sim.finished["a"]

    assert request.output_token_ids == alone.output_token_ids == [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    assert request.status == RequestStatus.FINISHED_LENGTH
    # The prefill samples 1 token, the next steps 3 confirmed drafts + 1 each; the last token has no room for drafts.
    assert [record.chunks[0][2] for record in sim.steps] == [12, 4, 4, 1]
    assert sim.scheduler.num_draft_tokens == sim.scheduler.num_accepted_tokens == 6


def test_rejected_drafts_are_computed_again_from_the_right_tokens() -> None:
    """A model that mostly repeats the token 4 places back, but at every fifth position adds one: drafts looked
    up in the text are partly wrong. Sim checks that no step reads the KV written for a rejected draft; the output
    is the plain one."""

    def mostly_periodic(request: Request) -> int:
        return request.token_ids[-PERIOD] + (request.num_tokens % 5 == 0)

    alone, sim = plain_and_speculative(mostly_periodic, [3, 4, 5, 6] * 4, drafts=4, max_tokens=16)

    assert sim.finished["a"].output_token_ids == alone.output_token_ids
    assert 0 < sim.scheduler.num_accepted_tokens < sim.scheduler.num_draft_tokens
    assert sim.kv.pool.num_free_blocks == sim.kv.pool.num_blocks


def test_a_stop_token_among_confirmed_drafts_ends_the_request_there() -> None:
    def periodic_then_eos(request: Request) -> int:
        return EOS if request.num_output_tokens == 5 else periodic(request)

    prompt = [3, 4, 5, 6] * 3
    sim = Sim(sampler=periodic_then_eos, speculative=SpeculativeConfig(num_speculative_tokens=4))
    request = sim.add("a", prompt, max_tokens=20, temperature=0)

    sim.run()

    assert request.output_token_ids == [3, 4, 5, 6, 3, EOS]
    assert sim.scheduler.num_accepted_tokens >= 4  # EOS came in a step that also confirmed drafts
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_requests_under_a_grammar_get_no_drafts() -> None:
    """Sampled requests take drafts (speculative sampling checks them); a grammar's requests do not."""
    sim = Sim(sampler=periodic, speculative=SpeculativeConfig(num_speculative_tokens=3))
    sampled = sim.add("a", [3, 4, 5, 6] * 3, max_tokens=6, temperature=0.8)
    structured = Request("b", [3, 4, 5, 6] * 3, SamplingParams(temperature=0, structured_outputs=object()))
    assert Scheduler.may_draft(sampled)
    assert not Scheduler.may_draft(structured)


def test_drafts_share_the_token_budget() -> None:
    sim = Sim(sampler=periodic, speculative=SpeculativeConfig(num_speculative_tokens=4), max_num_batched_tokens=6)
    a = sim.add("a", [3, 4, 5, 6] * 2, max_tokens=20, temperature=0)
    b = sim.add("b", [7, 8, 9, 10] * 2, max_tokens=20, temperature=0)
    sim.run()
    assert max(record.num_tokens for record in sim.steps) == 6  # Sim checks every step against the budget
    assert sim.scheduler.num_accepted_tokens > 0
    assert (a.output_token_ids, b.output_token_ids) == ([3, 4, 5, 6] * 5, [7, 8, 9, 10] * 5)


def test_stop_at_cuts_the_output_and_finishes_the_request():
    """A stop string found by the output processor: the scheduler drops the tokens after it and ends the request."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=512)
    scheduler = Scheduler(config, KVCacheManager(16, 16, enable_prefix_caching=False))
    request = Request("a", [5, 6, 7], SamplingParams(max_tokens=10))
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, {"a": [8]})
    request.token_ids += [9, 10]  # as if a step had appended three output tokens
    scheduler.stop_at(request, 5)
    assert request.token_ids == [5, 6, 7, 8, 9] and request.status == RequestStatus.FINISHED_STOPPED
    assert "a" not in scheduler.requests and scheduler.kv_cache.pool.num_used_blocks == 0
