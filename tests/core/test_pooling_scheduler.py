"""Pooling requests in the scheduler: computed whole in one step (never chunked), finished by that step, blocks
freed, and mixed with token budget limits like any request."""

from __future__ import annotations

from heteroserve.config import SchedulerConfig
from heteroserve.core.kv_cache_manager import KVCacheManager
from heteroserve.core.request import Request, RequestStatus
from heteroserve.core.scheduler import Scheduler
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams


def pooling_request(request_id: str, length: int) -> Request:
    return Request(request_id, list(range(3, 3 + length)), SamplingParams(max_tokens=1), pooling_params=PoolingParams())


def make_scheduler(budget: int, num_blocks: int = 64, max_num_seqs: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=512, pooling=True)
    return Scheduler(config, KVCacheManager(num_blocks, 16, enable_prefix_caching=False))


def run_step(scheduler: Scheduler) -> list[tuple[str, int]]:
    output = scheduler.schedule()
    scheduler.update_from_output(output, {})
    return [(item.request.request_id, item.num_new_tokens) for item in output.scheduled]


def test_pooling_requests_are_never_chunked_and_finish_in_their_step():
    scheduler = make_scheduler(budget=100)
    lengths = {"a": 60, "b": 30, "c": 50, "d": 100}
    for request_id, length in lengths.items():
        scheduler.add_request(pooling_request(request_id, length))
    steps = []
    while scheduler.has_unfinished_requests():
        steps.append(run_step(scheduler))
    # FCFS: c does not fit beside a and b (it would be cut), so it waits for the next step, with nothing after it.
    assert steps == [[("a", 60), ("b", 30)], [("c", 50)], [("d", 100)]]
    assert scheduler.kv_cache.pool.num_used_blocks == 0
    assert not scheduler.running and not scheduler.requests


def test_pooling_request_status_and_computed_tokens():
    scheduler = make_scheduler(budget=64)
    request = pooling_request("a", 40)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert [item.num_new_tokens for item in output.scheduled] == [40]
    finished = scheduler.update_from_output(output, {})
    assert finished == [request]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.num_computed_tokens == 40 and request.output_token_ids == []


def test_max_num_seqs_bounds_a_pooling_step():
    scheduler = make_scheduler(budget=1000, max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(pooling_request(str(i), 10))
    steps = []
    while scheduler.has_unfinished_requests():
        steps.append([request_id for request_id, _ in run_step(scheduler)])
    assert steps == [["0", "1"], ["2", "3"], ["4"]]


def test_default_budget_of_pooling_models_fits_the_longest_input():
    assert SchedulerConfig(max_model_len=32768, pooling=True).max_num_batched_tokens == 32768
    assert SchedulerConfig(max_model_len=512, pooling=True).max_num_batched_tokens == 8192
