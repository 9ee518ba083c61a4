"""LoRA in the scheduler and the prefix cache, without a model: at most max_loras adapters run at once (the others'
requests wait, keeping their place) and cache blocks are keyed by adapter."""

from __future__ import annotations

from heteroserve.config import SchedulerConfig
from heteroserve.core.kv_cache_manager import KVCacheManager
from heteroserve.core.request import Request, RequestStatus
from heteroserve.core.scheduler import Scheduler
from heteroserve.lora.request import LoRARequest
from heteroserve.sampling_params import SamplingParams

ADAPTERS = {i: LoRARequest(f"adapter-{i}", i, f"/adapters/{i}") for i in (1, 2, 3)}


def _request(request_id: str, adapter: int, prompt: list[int], max_tokens: int = 2) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        lora_request=ADAPTERS.get(adapter),
    )


def _run_to_end(scheduler: Scheduler) -> list[set[int]]:
    """Steps until every request finishes (the "model" samples token 7); the adapters of each step."""
    steps = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        assert output.scheduled, "nothing was scheduled while requests wait: one was dropped"
        steps.append({item.request.lora_id for item in output.scheduled if item.request.lora_id})
        sampled = {item.request.request_id: [7] for item in output.scheduled if item.samples}
        scheduler.update_from_output(output, sampled)
    return steps


def test_at_most_max_loras_adapters_per_step_and_nobody_is_dropped():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, max_loras=2)
    scheduler = Scheduler(config, KVCacheManager(64, 4))
    order = [1, 2, 3, 0, 1, 3, 2, 0, 3]
    requests = [_request(f"r{i}", adapter, [10 + i] * 5, max_tokens=2 + i % 3) for i, adapter in enumerate(order)]
    for request in requests:
        scheduler.add_request(request)
    first = scheduler.schedule()
    # adapter 3's requests wait; the base model's and the running adapters' later requests go ahead of them
    assert [item.request.request_id for item in first.scheduled] == ["r0", "r1", "r3", "r4", "r6", "r7"]
    scheduler.update_from_output(first, {item.request.request_id: [7] for item in first.scheduled})
    steps = _run_to_end(scheduler)
    assert all(len(adapters) <= 2 for adapters in steps), steps
    assert 3 in set().union(*steps)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)


def test_prefix_cache_blocks_are_keyed_by_adapter():
    kv = KVCacheManager(32, 4)
    prompt = list(range(100, 113))
    owner = _request("owner", 1, prompt)
    assert kv.allocate_slots(owner, len(prompt))
    owner.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(owner)
    same = _request("same", 1, prompt)
    assert kv.find_cached_prefix(same)[1] == 12
    for other in (_request("other", 2, prompt), _request("base", 0, prompt)):
        assert kv.find_cached_prefix(other) == ([], 0)
