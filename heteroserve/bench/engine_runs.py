"""heteroserve's own measurements: a batch of requests at once, and a single stream."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from heteroserve.engine.llm_engine import LLMEngine
from heteroserve.lora.request import LoRARequest
from heteroserve.sampling_params import RequestOutputKind, SamplingParams
from heteroserve.structured_output import StructuredOutputsParams

Requests = list[tuple[list[int], int]]


@dataclass
class BatchRun:
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    outputs: list[list[int]]
    peak_kv_blocks: int
    kv_blocks_allocated: int
    kv_blocks_needed: int  # sum over requests of ceil(tokens with KV / block_size)
    peak_rss_mib: float
    num_steps: int
    num_preemptions: int
    prefix_cache_hit_tokens: int  # prompt tokens whose KV the run found cached
    e2e_s: list[float]  # per request, arrival to finish


def structured_schema(index: int) -> StructuredOutputsParams:
    """`bench throughput --structured json-schema`: a JSON schema of its own for each request (so each compiles
    once), an object whose array needs more items than the output has tokens, so the grammar constrains every
    token and the output lengths stay those of the plain run."""
    notes = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 256}
    return StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {f"notes_{index}": notes, "count": {"type": "integer"}},
            "required": [f"notes_{index}", "count"],
            "additionalProperties": False,
        }
    )


def run_batch(
    engine: LLMEngine,
    requests: Requests,
    structured: Callable[[int], StructuredOutputsParams] | None = None,
    lora: Callable[[int], LoRARequest | None] | None = None,
) -> BatchRun:
    """All requests submitted at once, greedy with EOS ignored, stepped until every one finishes; with
    `structured`, request i's output follows the constraint structured(i); with `lora`, it runs under the
    adapter lora(i)."""
    kv_cache = engine.scheduler.kv_cache
    pool = kv_cache.pool
    block = engine.config.cache.block_size
    preemptions_before = engine.scheduler.num_preemptions
    hits_before = kv_cache.stats.hits
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured(i) if structured is not None else None,
        )
        adapter = lora(i) if lora is not None else None
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params, lora_request=adapter)
    outputs: dict[str, list[int]] = {}
    e2e: list[float] = []
    peak, steps = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
            e2e.append(out.metrics.finished_time - out.metrics.arrival_time)
        peak = max(peak, pool.num_used_blocks)
        steps += 1
    wall = time.perf_counter() - start
    ordered = [outputs[f"bench-{i}"] for i in range(len(requests))]
    # The last sampled token never gets KV, so a request holds ceil((P + G - 1) / block) blocks at most.
    needed = sum(-(-(len(p) + g - 1) // block) for p, g in requests)
    return BatchRun(
        wall_s=wall,
        output_tokens=sum(len(o) for o in ordered),
        prompt_tokens=sum(len(p) for p, _ in requests),
        outputs=ordered,
        peak_kv_blocks=peak,
        kv_blocks_allocated=pool.num_blocks,
        kv_blocks_needed=needed,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        num_steps=steps,
        num_preemptions=engine.scheduler.num_preemptions - preemptions_before,
        prefix_cache_hit_tokens=kv_cache.stats.hits - hits_before,
        e2e_s=e2e,
    )


def single_stream(engine: LLMEngine, prompt: list[int], output_len: int, repeats: int) -> dict[str, object]:
    """Time to first token and decode rate of one request, medians over `repeats` after a warm-up."""
    prefill, decode, inter_token = [], [], []
    for run in range(repeats + 1):
        params = SamplingParams(
            temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        start = time.perf_counter()
        engine.add_request(f"latency-{run}", {"prompt_token_ids": prompt}, params)
        stamps, counts = [], []  # when each step's output came, and how many tokens it brought
        while engine.has_unfinished_requests():
            for output in engine.step():
                stamps.append(time.perf_counter())
                counts.append(len(output.outputs[0].token_ids))
        if run == 0:
            continue  # warm-up
        prefill.append(stamps[0] - start)
        decode.append(sum(counts[1:]) / (stamps[-1] - stamps[0]))
        for before, after, count in zip(stamps, stamps[1:], counts[1:], strict=False):
            if count:
                inter_token += [(after - before) / count] * count  # speculative steps bring several tokens at once
    inter_token.sort()
    return {
        "inter_token_samples_ms": [1000 * x for x in inter_token],
        "prefill_ms": 1000 * statistics.median(prefill),
        "decode_tokens_per_s": statistics.median(decode),
        "inter_token_ms": {
            f"p{q}": 1000 * inter_token[min(len(inter_token) - 1, int(q / 100 * len(inter_token)))]
            for q in (50, 90, 99)
        },
    }


def time_to_first_token(engine: LLMEngine, request_id: str, prompt: list[int], output_len: int) -> float:
    """Seconds from add_request to the first output of one request run alone (then runs it to the end)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    first = None
    while engine.has_unfinished_requests():
        if engine.step() and first is None:
            first = time.perf_counter() - start
    return first
