"""Speculative decoding with n-gram drafts on the default model: the greedy tokens, logprobs, stop rules and KV
blocks of plain decoding, in fewer steps where the text repeats itself."""

from __future__ import annotations

import pytest
import torch

from heteroserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
ENGINE_KWARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 128 * 1024**2, "quantization": "none"}
REPEATING = " ".join(["Paged attention stores the key value cache in fixed size blocks."] * 4)
# The default model answers this by repeating one sentence of its own, which n-gram drafts predict.
ECHOING = "Request 0: " + " ".join(
    ["The quick brown fox jumps over the lazy dog. Large language models generate text one token at a time."] * 2
)
PROMPTS = [
    ECHOING,
    REPEATING,
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The capital of France is",
    "1, 1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def speculative_llm() -> LLM:
    return LLM(**ENGINE_KWARGS, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def prompt_ids(default_tokenizer) -> list[list[int]]:
    return [default_tokenizer.encode(p) for p in PROMPTS]


def test_greedy_tokens_and_logprobs_are_transformers(speculative_llm, prompt_ids, hf_default, greedy_comparison):
    scheduler = speculative_llm.engine.scheduler
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=1)
    outputs = speculative_llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    assert scheduler.num_accepted_tokens > 0, "the repeating prompt's drafts were never confirmed"
    assert scheduler.num_accepted_tokens < scheduler.num_draft_tokens, "some drafts should have been wrong"
    for i, (prompt, output) in enumerate(zip(prompt_ids, outputs, strict=True)):
        ours, ref = output.outputs[0], hf_default.greedy(prompt, 32)
        greedy_comparison.check(f"speculative[{i}]", ours.token_ids, ref)
        assert len(ours.logprobs) == len(ours.token_ids)
        for step, (token, theirs) in enumerate(zip(ours.token_ids, ref.tokens, strict=False)):
            if token != theirs:
                break
            expected = torch.log_softmax(ref.logits[step], -1)[token].item()
            assert abs(ours.logprobs[step][token].logprob - expected) < 1e-3, (i, step)
    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks  # rejected drafts' slots went back with their requests


def test_every_confirmed_draft_saves_a_step(speculative_llm, default_llm, prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = []
    for llm in (default_llm, speculative_llm):
        engine = llm.engine
        accepted_before = engine.scheduler.num_accepted_tokens
        engine.add_request("echo", {"prompt_token_ids": prompt_ids[0]}, params)
        steps = 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
        runs.append((steps, outputs[0].outputs[0].token_ids, engine.scheduler.num_accepted_tokens - accepted_before))
    (plain_steps, plain_tokens, _), (spec_steps, spec_tokens, accepted) = runs
    assert spec_tokens == plain_tokens and len(spec_tokens) == plain_steps == 48
    assert accepted >= 12, "the model repeats its own sentence: most drafts should be right"
    assert spec_steps == plain_steps - accepted


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=40, stop=["fixed size"]),  # a stop string inside confirmed drafts
        SamplingParams(temperature=0, max_tokens=40, stop=["fixed size"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=7),  # max_tokens cuts the drafts
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, min_tokens=5),  # per-row penalties
    ],
)
def test_outputs_equal_plain_decoding(speculative_llm, default_llm, prompt_ids, params):
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    plain = default_llm.generate(prompts, params, use_tqdm=False)
    ours = speculative_llm.generate(prompts, params, use_tqdm=False)
    for mine, theirs in zip(ours, plain, strict=True):
        a, b = mine.outputs[0], theirs.outputs[0]
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)


def test_sampled_requests_take_drafts_and_keep_their_seed(speculative_llm, prompt_ids):
    """A seeded sampled request gives the same tokens twice with drafts checked by speculative sampling (that
    the draws keep the model's distribution: test_draft_model.py's chi-square tests, the n-gram one included)."""
    scheduler = speculative_llm.engine.scheduler
    before = scheduler.num_draft_tokens
    params = SamplingParams(temperature=0.3, max_tokens=32, seed=3)
    first = speculative_llm.generate([{"prompt_token_ids": prompt_ids[4]}], params, use_tqdm=False)
    assert scheduler.num_draft_tokens > before
    again = speculative_llm.generate([{"prompt_token_ids": prompt_ids[4]}], params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids


def test_bad_speculative_config_is_an_error():
    with pytest.raises(ValueError, match="unknown speculative_config keys: draft_tensor_parallel_size"):
        LLM(**ENGINE_KWARGS, speculative_config={"method": "ngram", "draft_tensor_parallel_size": 1})


def test_self_int4_draft_gives_the_float_models_tokens(prompt_ids, default_llm, hf_default, greedy_comparison):
    """The default model served in float32, drafted by its own Q4_1 blocks: the float model's greedy tokens and
    logprobs (against transformers and against plain decoding), most drafts confirmed (the float weights are the
    Q4_1 values dequantised, so the two differ only by the 4-bit kernel's arithmetic)."""
    llm = LLM(**ENGINE_KWARGS, speculative_config={"model": "self-int4", "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    plain = default_llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, output, expected) in enumerate(zip(prompt_ids, outputs, plain, strict=True)):
        ours = output.outputs[0]
        greedy_comparison.check(f"self-int4[{i}]", ours.token_ids, hf_default.greedy(prompt, 32))
        assert ours.token_ids == expected.outputs[0].token_ids
        for mine, theirs in zip(ours.logprobs, expected.outputs[0].logprobs, strict=True):
            token = next(iter(theirs))
            assert abs(mine[token].logprob - theirs[token].logprob) < 1e-4
    stats = llm.engine.stats()
    print(f"self-int4: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} drafts confirmed")
    assert stats.spec_accepted_tokens > 0.8 * stats.spec_draft_tokens
