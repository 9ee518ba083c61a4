"""--max-prefill-tokens-per-step without a model: a burst is prefilled over several steps, the first requests
decoding alongside the later prompts, and every request still finishes."""

from __future__ import annotations

from heteroserve.config import SchedulerConfig
from heteroserve.core.kv_cache_manager import KVCacheManager
from heteroserve.core.request import Request
from heteroserve.core.scheduler import Scheduler
from heteroserve.sampling_params import SamplingParams


def _burst(cap: int | None) -> tuple[list[list[tuple[str, int]]], list[int]]:
    """16 prompts of 128 tokens arriving together, 4 output tokens each: each step's (request, tokens), and the
    step in which each request got its first token."""
    config = SchedulerConfig(max_num_batched_tokens=2048, max_model_len=512, max_prefill_tokens_per_step=cap)
    scheduler = Scheduler(config, KVCacheManager(512, 16))
    requests = [Request(f"r{i}", [3 + i] * 128, SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(16)]
    for request in requests:
        scheduler.add_request(request)
    steps = []
    first_token = {}
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        steps.append([(item.request.request_id, item.num_new_tokens) for item in output.scheduled])
        sampled = {item.request.request_id: [9] for item in output.scheduled if item.samples}
        for request_id in sampled:
            first_token.setdefault(request_id, len(steps))
        scheduler.update_from_output(output, sampled)
    return steps, [first_token[r.request_id] for r in requests]


def test_a_burst_is_prefilled_in_capped_steps():
    steps, first = _burst(512)
    prompt_tokens = [sum(n for _, n in step if n > 1) for step in steps]
    assert prompt_tokens[:4] == [512, 512, 512, 512]
    assert first == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert ("r0", 1) in steps[1], "the first requests decode while the next prompts prefill"


def test_without_a_cap_the_burst_is_one_step():
    steps, first = _burst(None)
    assert sum(n for _, n in steps[0]) == 2048 and first == [1] * 16


def test_long_prompts_are_chunked_by_the_cap_but_a_lone_one_is_not():
    config = SchedulerConfig(max_num_batched_tokens=2048, max_model_len=2048, max_prefill_tokens_per_step=300)
    scheduler = Scheduler(config, KVCacheManager(256, 16))
    for name, first in (("a", 0), ("b", 1000)):
        scheduler.add_request(Request(name, list(range(first, first + 1000)), SamplingParams(max_tokens=1)))
    chunks = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        chunks.append([(item.request.request_id, item.num_new_tokens) for item in output.scheduled])
        scheduler.update_from_output(output, {i.request.request_id: [5] for i in output.scheduled if i.samples})
    # a's prompt in capped chunks while b waits; b, alone once a is done, takes what is left of its prompt at once
    assert chunks == [[("a", 300)], [("a", 300)], [("a", 300)], [("a", 100), ("b", 200)], [("b", 800)]]
