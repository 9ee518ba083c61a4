"""Greedy output of the default model equals transformers', however the engine batches it."""

from __future__ import annotations

import os

import pytest
import torch

from heteroserve import LLM, SamplingParams

# scripts/test-aarch64.sh runs this file under emulation (~170x slower): the first few prompts and tokens only.
MAX_TOKENS = int(os.environ.get("HETEROSERVE_GREEDY_TOKENS", "24"))
NUM_PROMPTS = int(os.environ.get("HETEROSERVE_GREEDY_PROMPTS", "0")) or None
TEXT_PROMPTS = [
    "The capital of France is",
    "你好，请用中文介绍一下北京的历史。",
    "def quicksort(arr):\n",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "1, 1, 2, 3, 5, 8, 13,",
    " ".join(["Paged attention stores the key value cache in fixed size blocks."] * 6) + " In short,",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "请把这句话翻译成英文：我喜欢学习。"}],
]
ENGINE_KWARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 128 * 1024**2, "quantization": "none"}
# Keys and values rounded to 16 bits move the default model's logprobs by up to ~5e-3 (float16) and ~6e-2
# (bfloat16, one step of one prompt on an AVX2 machine; ~2e-2 on AVX-512 ones) from transformers' float32 ones on
# these prompts: a divergence is accepted below these top-2 gaps.
KV_ROUNDING = {"float16": 2e-2, "bfloat16": 6e-2}
# The largest logprob difference on the tokens both pick: bfloat16 keeps 3 fewer mantissa bits than float16, so
# its bound is 8x float16's.
KV_LOGPROB_BOUND = {"float16": 1e-2, "bfloat16": 8e-2}


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    ids = [default_tokenizer.encode(p) for p in TEXT_PROMPTS]
    for conversation in CHAT_PROMPTS:
        text = default_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        ids.append(default_tokenizer.encode(text, add_special_tokens=False))
    return ids[:NUM_PROMPTS]


@pytest.fixture(scope="module")
def references(hf_default, prompts):
    return [hf_default.greedy(p, MAX_TOKENS) for p in prompts]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_chat_answer_is_paris(default_llm):
    out = default_llm.chat(CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"


def test_one_at_a_time(default_llm, prompts, references, greedy_comparison):
    for i, (prompt, ref) in enumerate(zip(prompts, references, strict=True)):
        greedy_comparison.check(f"alone[{i}]", _generate(default_llm, [prompt])[0], ref)


def test_all_together(default_llm, prompts, references, greedy_comparison):
    for i, (ours, ref) in enumerate(zip(_generate(default_llm, prompts), references, strict=True)):
        greedy_comparison.check(f"batched[{i}]", ours, ref)


def test_prefix_cache_hits_keep_outputs(default_llm, prompts, references, greedy_comparison):
    """The same prompts again hit the prefix cache and still match."""
    before = default_llm.engine.stats().prefix_hits
    for i, (ours, ref) in enumerate(zip(_generate(default_llm, prompts), references, strict=True)):
        greedy_comparison.check(f"cached[{i}]", ours, ref)
    assert default_llm.engine.stats().prefix_hits > before


@pytest.mark.parametrize(
    "label, kwargs",
    [
        ("no-prefix-cache", {"enable_prefix_caching": False}),
        ("chunked-16", {"max_num_batched_tokens": 16, "max_num_seqs": 4}),
        ("no-chunking", {"enable_chunked_prefill": False, "max_num_seqs": 3}),
    ],
)
def test_scheduling_variants(label, kwargs, prompts, references, greedy_comparison):
    llm = LLM(**{**ENGINE_KWARGS, **kwargs})
    for i, (ours, ref) in enumerate(zip(_generate(llm, prompts), references, strict=True)):
        greedy_comparison.check(f"{label}[{i}]", ours, ref)


def test_preemption_by_recompute(prompts, references, greedy_comparison):
    """A pool of 8 blocks x 16 tokens cannot hold all requests: they are preempted and recomputed."""
    llm = LLM(max_model_len=128, num_kv_blocks=8, max_num_batched_tokens=64, quantization="none")
    outputs = _generate(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv_cache.pool.num_free_blocks == 8
    for i, (ours, ref) in enumerate(zip(outputs, references, strict=True)):
        greedy_comparison.check(f"preempted[{i}]", ours, ref)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_16bit_kv_cache(kv_cache_dtype, default_llm, prompts, references, greedy_comparison):
    """--kv-cache-dtype under float32 activations: twice the blocks in the same memory, and transformers' float32
    tokens and logprobs to within the cache's rounding."""
    llm = LLM(**ENGINE_KWARGS, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.executor.worker.runner
    assert runner.kv_cache.dtype == getattr(torch, kv_cache_dtype)
    assert runner.num_blocks == 2 * default_llm.engine.executor.worker.runner.num_blocks
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tolerance, bound = KV_ROUNDING[kv_cache_dtype], KV_LOGPROB_BOUND[kv_cache_dtype]
    for i, (output, ref) in enumerate(zip(outputs, references, strict=True)):
        ours = output.outputs[0]
        greedy_comparison.check(f"kv-{kv_cache_dtype}[{i}]", ours.token_ids, ref, near_tie=tolerance)
        for step, (token, theirs) in enumerate(zip(ours.token_ids, ref.tokens, strict=False)):
            if token != theirs:
                break
            expected = torch.log_softmax(ref.logits[step], -1)[token].item()
            assert abs(ours.logprobs[step][token].logprob - expected) < bound, (i, step)
